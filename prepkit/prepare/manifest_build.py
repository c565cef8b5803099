"""The end of a run: shared files linked into every rank folder, each rank's safetensors index, and
the manifest, written last."""

from __future__ import annotations

from pathlib import Path

from prepkit import __version__
from prepkit.constants import DENSE_MX_LAYOUT_ID, INDEX_NAME, MANIFEST_NAME
from prepkit.layouts.dense_mx import stored_names
from prepkit.manifest import (
    DenseRecord,
    DenseTensorRecord,
    FileHash,
    LayoutRecord,
    Manifest,
    ModelRecord,
    Parallel,
    Provenance,
    RankRecord,
    TensorRecord,
    experts_file,
    shared_file,
)
from prepkit.model_files import copy_model_files
from prepkit.prepare.plan import PreparePlan, used_options
from prepkit.shards import Journal, WrittenFile, link_or_copy, write_output_json


def write_indexes_and_manifest(plan: PreparePlan, files: dict[str, WrittenFile], provenance: Provenance) -> Manifest:
    """Link shared files into every rank, write rank indexes, then the manifest, last (its
    presence is what marks the folder finished)."""
    root = plan.out_dir
    ckpt = plan.checkpoint
    link_method = "none"
    rank_entries = []
    quantized = set(plan.quantized_names())
    for p in plan.ranks:
        r = p.spec.rank
        weight_map: dict[str, str] = {}
        rank_files = []
        for i, names in enumerate(plan.shared_groups):
            rel = shared_file(i)
            local = f"rank{r}/{Path(rel).name}"
            link_method = link_or_copy(root / rel, root / local)
            rank_files.append(local)
            for n in names:
                for stored in stored_names(n) if n in quantized else (n,):
                    weight_map[stored] = Path(rel).name
        for layer in range(ckpt.dims.num_layers):
            rel = experts_file(r, layer)
            rank_files.append(rel)
            prefix = plan.recipe.output_expert_prefix(layer)
            for n in p.tensors:
                weight_map[prefix + n] = Path(rel).name
        total = p.layer_nbytes() * ckpt.dims.num_layers + plan.shared_bytes
        index = {
            "metadata": {"total_size": total, "prepkit_layout": plan.layout.layout_id, "rank": r},
            "weight_map": dict(sorted(weight_map.items())),
        }
        files[f"rank{r}/{INDEX_NAME}"] = write_output_json(root, f"rank{r}/{INDEX_NAME}", index)
        rank_files.append(f"rank{r}/{INDEX_NAME}")
        rank_entries.append(
            RankRecord(
                rank=r,
                tp_rank=p.spec.tp_rank,
                ep_rank=p.spec.ep_rank,
                expert_range=p.expert_range,
                intermediate_range=p.intermediate_range,
                valid_intermediate=p.valid_intermediate,
                padded_intermediate=p.padded_intermediate,
                padded_hidden=p.padded_hidden,
                sharding_rule=p.sharding_rule,
                facts=p.facts,
                tensors={
                    n: TensorRecord(t.shape, str(t.dtype).removeprefix("torch."), t.dims) for n, t in p.tensors.items()
                },
                files=tuple(sorted(rank_files)),
            )
        )
    # Tokenizer and generation defaults, so the prepared folder serves a model on its own.
    files.update(copy_model_files(ckpt.root, root))
    manifest = Manifest(
        prepkit_version=__version__,
        fingerprint=plan.fingerprint,
        layout=LayoutRecord(
            name=plan.layout.name,
            id=plan.layout.layout_id,
            w13_row_order=plan.layout.w13_row_order,
            options=used_options(plan),
        ),
        model=ModelRecord(
            recipe=plan.recipe.name,
            repo_id=plan.recipe.repo_id,
            revision=plan.recipe.revision,
            dims=ckpt.dims,
            config=ckpt.config,
            provenance=provenance,
        ),
        parallel=Parallel(tp_size=plan.tp_size, ep_size=plan.ep_size),
        expert_tensor_prefix=plan.recipe.expert_prefix,
        shared_files=tuple(shared_file(i) for i in range(len(plan.shared_groups))),
        shared_file_link=link_method,
        ranks=tuple(rank_entries),
        files={rel: FileHash(wf.sha256, wf.bytes) for rel, wf in sorted(files.items())},
        dense=_dense_record(plan),
    )
    write_output_json(root, MANIFEST_NAME, manifest.to_json())
    Journal(root, plan.fingerprint).remove()
    return manifest


def _dense_record(plan: PreparePlan) -> DenseRecord | None:
    """What the manifest says of the MX dense weights; None for bf16 (the manifest unchanged)."""
    names = plan.quantized_names()
    if not names:
        return None
    tensors = {}
    for n in names:
        blocks, scales = stored_names(n)
        tensors[n] = DenseTensorRecord(plan.dense, plan.checkpoint.entries[n].shape, blocks, scales)
    return DenseRecord(plan.dense, DENSE_MX_LAYOUT_ID, tensors)

"""``prepare``'s plan: the source validated, every rank's tensors and bytes decided, the shared
files grouped, and the output folder checked; nothing is written."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prepkit.checkpoint import Checkpoint
from prepkit.constants import DEFAULT_DENSE_FORMAT, DENSE_MX_LAYOUT_ID, PREPARE_LOCK
from prepkit.errors import OutputError
from prepkit.fsutil import free_bytes
from prepkit.layouts import Layout, LayoutOptions, RankPlan, RankSpec
from prepkit.layouts.base import check_split
from prepkit.layouts.dense_mx import is_dense_weight, mx_format
from prepkit.locks import holder_pid, is_held
from prepkit.manifest import experts_file, shared_file
from prepkit.prepare.dense import check_dense_weights, check_layout_reads, is_quantized, stored_bytes
from prepkit.prepare.guard import busy_error_for, check_output_dir, fingerprint_of, finished_files, plan_identity
from prepkit.recipes import Recipe

CHUNK_BYTES = 256 * 1024 * 1024  # source bytes read per step; bounds memory, keeps torch ops large
SHARED_FILE_BYTES = 2 * 1024**3  # non-expert tensors are grouped into files of at most this payload


@dataclass
class PreparePlan:
    recipe: Recipe
    checkpoint: Checkpoint
    layout: Layout
    options: LayoutOptions
    tp_size: int
    ep_size: int
    out_dir: Path
    ranks: list[RankPlan]
    shared_groups: list[list[str]]  # checkpoint names (an MX dense weight is stored as two tensors)
    expert_source_bytes: int
    shared_bytes: int  # what the shared files hold (less than the source's with MX dense weights)
    output_bytes_per_rank: list[int]
    free_bytes: int
    fingerprint: str
    warnings: list[str] = field(default_factory=list)
    chunk_bytes: int = CHUNK_BYTES
    identity: dict[str, Any] = field(default_factory=dict)  # what the fingerprint hashes, spelled out
    # Output files an earlier run of this plan finished (resumed, not written again).
    finished: frozenset[str] = frozenset()
    dense: str = DEFAULT_DENSE_FORMAT  # --dense: how the shared files hold the dense weights

    def shared_tensor_bytes(self, name: str) -> int:
        """Bytes the shared files hold for checkpoint tensor ``name``."""
        return stored_bytes(self.checkpoint.entries[name], self.dense)

    @property
    def shared_source_bytes(self) -> int:
        """Source bytes of the shared tensors: what the run reads for the shared files."""
        return sum(self.checkpoint.entries[n].nbytes for names in self.shared_groups for n in names)

    def quantized_names(self) -> list[str]:
        """The checkpoint's dense weights this plan stores in MX form (none for bf16)."""
        return [n for names in self.shared_groups for n in names if is_quantized(n, self.dense)]

    def dense_summary(self) -> dict[str, Any]:
        """The dense weights' format and bytes, against the checkpoint's bf16."""
        names = [n for names in self.shared_groups for n in names if is_dense_weight(n)]
        bf16 = sum(self.checkpoint.entries[n].nbytes for n in names)
        stored = sum(self.shared_tensor_bytes(n) for n in names)
        return {
            "format": self.dense,
            "layout_id": DENSE_MX_LAYOUT_ID if self.dense != DEFAULT_DENSE_FORMAT else None,
            "tensors": len(names),
            "bf16_bytes": bf16,
            "bytes": stored,
            "bytes_saved": bf16 - stored,
        }

    @property
    def bytes_to_write(self) -> int:
        """The whole output's tensor bytes, finished files included."""
        return sum(self.output_bytes_per_rank) + self.shared_bytes

    @property
    def bytes_left(self) -> int:
        """Tensor bytes of the files not finished yet: what a (resumed) run still needs on disk."""
        return sum(size for rel, size in self.planned_files().items() if rel not in self.finished)

    def planned_files(self) -> dict[str, int]:
        """Every tensor file the run writes, by path under the output folder, with its tensor bytes."""
        files = {
            shared_file(i): sum(self.shared_tensor_bytes(n) for n in names)
            for i, names in enumerate(self.shared_groups)
        }
        for p in self.ranks:
            for layer in range(self.checkpoint.dims.num_layers):
                files[experts_file(p.spec.rank, layer)] = p.layer_nbytes()
        return files

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.recipe.name,
            "source": str(self.checkpoint.root),
            "out": str(self.out_dir),
            "layout": self.layout.name,
            "layout_id": self.layout.layout_id,
            "options": used_options(self),
            "tp_size": self.tp_size,
            "ep_size": self.ep_size,
            "num_layers": self.checkpoint.dims.num_layers,
            "dims": self.checkpoint.dims.__dict__,
            "ranks": [
                {
                    "rank": p.spec.rank,
                    "tp_rank": p.spec.tp_rank,
                    "ep_rank": p.spec.ep_rank,
                    "experts": list(p.expert_range),
                    "intermediate_rows": list(p.intermediate_range),
                    "valid_intermediate": p.valid_intermediate,
                    "padded_intermediate": p.padded_intermediate,
                    "sharding_rule": p.sharding_rule,
                    "bytes": self.output_bytes_per_rank[i],
                    "tensors_per_layer": {n: list(t.shape) for n, t in p.tensors.items()},
                }
                for i, p in enumerate(self.ranks)
            ],
            "expert_source_bytes": self.expert_source_bytes,
            "shared_bytes": self.shared_bytes,
            "dense": self.dense_summary(),
            "bytes_to_write": self.bytes_to_write,
            "bytes_left": self.bytes_left,
            "free_bytes": self.free_bytes,
            "warnings": self.warnings,
        }


def used_options(plan: PreparePlan) -> dict[str, Any]:
    return {name: getattr(plan.options, name) for name in getattr(plan.layout, "uses_options", ())}


def plan_prepare(
    recipe: Recipe,
    src: Path,
    layout: Layout,
    *,
    tp_size: int,
    ep_size: int = 1,
    out_dir: Path,
    options: LayoutOptions | None = None,
    ranks: list[int] | None = None,
    dense: str = DEFAULT_DENSE_FORMAT,
) -> PreparePlan:
    """Validate the source and the split, and decide every byte's place; writes nothing.

    Raises CheckpointError (bad source), LayoutError (a split that does not fit, an MX ``dense``
    format the layout's engine cannot read), OutputError (foreign output folder, not enough disk).
    """
    options = options or LayoutOptions()
    if dense != DEFAULT_DENSE_FORMAT:
        fmt = mx_format(dense)
        check_layout_reads(layout, dense)
    if tp_size < 1 or ep_size < 1:
        raise OutputError(f"--tp and --ep must be at least 1 (got tp={tp_size}, ep={ep_size})")
    checkpoint = Checkpoint(src, recipe)
    checkpoint.validate()
    if dense != DEFAULT_DENSE_FORMAT:
        check_dense_weights(checkpoint, [n for n in checkpoint.non_expert_names() if is_dense_weight(n)], fmt)
    dims = checkpoint.dims
    check_split(dims, tp_size, ep_size)  # before any rank is built: a huge --tp costs nothing
    world_size = tp_size * ep_size
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise OutputError(
                f"--rank {bad[0]} is out of range for tp={tp_size} x ep={ep_size}",
                hint=f"ranks are 0..{world_size - 1}",
            )
    specs = RankSpec.all_ranks(tp_size, ep_size)
    if ranks is not None:
        specs = [specs[r] for r in sorted(set(ranks))]
    rank_plans = [layout.plan_rank(dims, spec, options) for spec in specs]

    warnings = layout.plan_warnings(dims, rank_plans, options)

    shared_names = checkpoint.non_expert_names()
    groups: list[list[str]] = [[]]
    used = 0
    for name in shared_names:
        size = stored_bytes(checkpoint.entries[name], dense)
        if groups[-1] and used + size > SHARED_FILE_BYTES:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    groups = [g for g in groups if g]
    shared_bytes = sum(stored_bytes(checkpoint.entries[n], dense) for n in shared_names)
    expert_bytes = sum(
        checkpoint.entries[n].nbytes for layer in range(dims.num_layers) for n in checkpoint.expert_names(layer)
    )
    per_rank = [p.layer_nbytes() * dims.num_layers for p in rank_plans]
    out_dir = Path(out_dir)
    identity = plan_identity(checkpoint, layout, options, tp_size, ep_size, [p.spec.rank for p in rank_plans], dense)
    fingerprint = fingerprint_of(identity)
    lock = out_dir / PREPARE_LOCK
    if is_held(lock):
        raise busy_error_for(out_dir)(holder_pid(lock))
    check_output_dir(out_dir, fingerprint, identity)
    plan = PreparePlan(
        recipe=recipe,
        checkpoint=checkpoint,
        layout=layout,
        options=options,
        tp_size=tp_size,
        ep_size=ep_size,
        out_dir=out_dir,
        ranks=rank_plans,
        shared_groups=groups,
        expert_source_bytes=expert_bytes,
        shared_bytes=shared_bytes,
        output_bytes_per_rank=per_rank,
        free_bytes=free_bytes(out_dir),
        fingerprint=fingerprint,
        warnings=warnings,
        identity=identity,
        dense=dense,
    )
    plan.finished = frozenset(finished_files(out_dir, fingerprint, plan.planned_files()))
    return plan

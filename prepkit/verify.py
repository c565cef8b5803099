"""``verify``: every output file against the manifest's sha256, and optionally every (or a sample
of) expert inverted through its layout and compared with the source checkpoint's bytes, every
other tensor with the source's, and each MX dense weight dequantized and held to its format's
rounding bound."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from prepkit.checkpoint import Checkpoint
from prepkit.constants import INDEX_NAME
from prepkit.errors import CheckpointError, LayoutError, OutputError, VerifyError
from prepkit.fsutil import sha256_file
from prepkit.layouts import LayoutOptions, RankSpec, get_layout
from prepkit.layouts.dense_mx import mx_format
from prepkit.manifest import SYNTHESIZED, DenseRecord, DenseTensorRecord, Manifest, experts_file
from prepkit.prepare.dense import check_stored_weight
from prepkit.recipes import load_recipe

ProgressFn = Callable[[str, int, int], None]


@dataclass
class VerifyReport:
    out_dir: Path
    files_checked: int = 0
    experts_checked: int = 0
    shared_tensors_checked: int = 0
    problems: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "out": str(self.out_dir),
            "ok": not self.problems,
            "files_checked": self.files_checked,
            "experts_checked": self.experts_checked,
            "shared_tensors_checked": self.shared_tensors_checked,
            "problems": self.problems,
        }


def verify(
    out_dir: str | Path,
    *,
    src: str | Path | None = None,
    src_from_cache: bool = False,
    sample: int | None = None,
    seed: int = 0,
    on_progress: ProgressFn | None = None,
) -> VerifyReport:
    """Check a shard set; raises VerifyError listing every problem (rank, layer, expert, tensor).
    With ``src_from_cache``, the source is the snapshot the manifest names, in the Hugging Face cache."""
    root = Path(out_dir)
    if not root.is_dir():
        raise OutputError(f"{root}: no such folder", hint="pass the folder `prepkit prepare` wrote (its --out)")
    manifest = Manifest.read(root)
    if src_from_cache:
        src = cached_source(manifest)
    report = VerifyReport(root)
    progress = on_progress or (lambda label, done, total: None)
    total = sum(f.bytes for f in manifest.files.values())
    done = 0
    for rel, recorded in sorted(manifest.files.items()):
        path = root / rel
        if not path.is_file():
            report.problems.append(f"{rel}: missing")
        elif path.stat().st_size != recorded.bytes:
            report.problems.append(f"{rel}: {path.stat().st_size} bytes, manifest says {recorded.bytes}")
        elif sha256_file(path) != recorded.sha256:
            report.problems.append(f"{rel}: sha256 differs from the manifest")
        report.files_checked += 1
        done += recorded.bytes
        progress("hashes", done, total)
    for rank in manifest.ranks:
        for rel in rank.files:
            if not (root / rel).is_file():
                report.problems.append(f"rank {rank.rank}: {rel} is missing")
    if src is not None and not report.problems:
        _verify_against_source(root, manifest, Path(src), sample, seed, report, progress)
    if report.problems:
        shown = report.problems[:25]
        more = f"\n  ... and {len(report.problems) - 25} more" if len(report.problems) > 25 else ""
        raise VerifyError(
            f"{root}: {len(report.problems)} problem(s):\n  " + "\n  ".join(shown) + more,
            hint="rerun prepkit prepare into a fresh folder (or delete the bad files and rerun to resume)",
        )
    return report


def cached_source(manifest: Manifest) -> Path:
    """The snapshot of the repo and commit the manifest records (those of the fetch it cites, else its
    recipe's), in the Hugging Face cache.

    Raises:
        CheckpointError: the cache holds no such snapshot.
    """
    from prepkit.fetch import find_model_dir
    from prepkit.fetch.cache import hub_cache_dir

    model = manifest.model
    repo = model.provenance.source_repo or model.repo_id
    commit = model.provenance.source_commit or model.revision
    folder = find_model_dir(repo, commit)
    if not (folder / INDEX_NAME).is_file():
        made_from = "a synthetic checkpoint" if model.provenance.kind == SYNTHESIZED else f"{repo} at {commit}"
        raise CheckpointError(
            f"the shards were made from {made_from}, and the Hugging Face cache {hub_cache_dir()} has no "
            "snapshot of it",
            hint=f"fetch it with `prepkit fetch {repo} --revision {commit}`, or give the source folder with --src DIR",
        )
    return folder


def _verify_against_source(
    root: Path,
    manifest: Manifest,
    src: Path,
    sample: int | None,
    seed: int,
    report: VerifyReport,
    progress: ProgressFn,
) -> None:
    recipe = load_recipe(manifest.model.recipe)
    ckpt = Checkpoint(src, recipe)
    ckpt.validate()
    layout = get_layout(manifest.layout.id)
    options = LayoutOptions(**manifest.layout.options)
    dims = ckpt.dims
    if dims != manifest.model.dims:
        raise VerifyError(
            f"--src {src} has dims {asdict(dims)}, the shards were made from {asdict(manifest.model.dims)}"
        )
    tp, ep = manifest.parallel.tp_size, manifest.parallel.ep_size
    rng = random.Random(seed)
    steps = len(manifest.ranks) * dims.num_layers
    step = 0
    for entry in manifest.ranks:
        spec = RankSpec(tp_size=tp, tp_rank=entry.tp_rank, ep_size=ep, ep_rank=entry.ep_rank)
        plan = layout.plan_rank(dims, spec, options)
        r = spec.rank
        if plan.intermediate_range != entry.intermediate_range:
            report.problems.append(
                f"rank {r}: manifest says intermediate rows {list(entry.intermediate_range)}, "
                f"the layout gives {list(plan.intermediate_range)}"
            )
            continue
        e_lo, e_hi = plan.expert_range
        for layer in range(dims.num_layers):
            experts = list(range(e_lo, e_hi))
            if sample is not None and sample < len(experts):
                experts = sorted(rng.sample(experts, sample))
            prefix = recipe.output_expert_prefix(layer)
            rel = experts_file(r, layer)
            with safe_open(str(root / rel), framework="pt") as f:
                for e in experts:
                    local = e - e_lo
                    tensors = {n: f.get_slice(prefix + n)[local : local + 1] for n in plan.tensors}
                    where = f"rank {r}, layer {layer}, expert {e}"
                    try:
                        got = layout.invert(tensors, plan)
                    except LayoutError as err:
                        report.problems.append(f"{where}: {err}")
                        continue
                    want = ckpt.read_experts_range(layer, e, e + 1).intermediate_slice(*plan.intermediate_range)
                    for role, t in want.as_dict().items():
                        if not torch.equal(got.as_dict()[role], t):
                            report.problems.append(f"{where}: {role} differs from the source after inversion")
                    report.experts_checked += 1
            step += 1
            progress("experts", step, steps)
    _verify_shared_tensors(root, manifest, ckpt, report)


def _verify_shared_tensors(root: Path, manifest: Manifest, ckpt: Checkpoint, report: VerifyReport) -> None:
    """Every non-expert tensor equal to the source's; an MX dense weight's two stored tensors
    checked together against their source weight."""
    # Rank folders hold links to these same files, whose hashes were checked above.
    shared = set(ckpt.non_expert_names())
    dense = manifest.dense.tensors if manifest.dense is not None else {}
    stored_as = {stored: name for name, t in dense.items() for stored in (t.blocks, t.scales)}
    expected = (shared - set(dense)) | set(stored_as)
    found: dict[str, str] = {}  # stored MX tensor -> the shared file holding it
    for rel in manifest.shared_files:
        with safe_open(str(root / rel), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open handles are not dicts)
                if name not in expected:
                    report.problems.append(f"{rel}: unexpected tensor {name}")
                    continue
                if name in stored_as:
                    found[name] = rel
                    continue
                if not torch.equal(f.get_tensor(name), ckpt.read(name)):
                    report.problems.append(f"{rel}: {name} differs from the source")
                report.shared_tensors_checked += 1
    if manifest.dense is not None:
        _verify_dense_weights(root, manifest.dense, ckpt, shared, found, report)
    if report.shared_tensors_checked != len(shared):
        report.problems.append(f"shared files hold {report.shared_tensors_checked} of {len(shared)} non-expert tensors")


def _verify_dense_weights(
    root: Path, dense: DenseRecord, ckpt: Checkpoint, shared: set[str], found: dict[str, str], report: VerifyReport
) -> None:
    for name, record in sorted(dense.tensors.items()):
        missing = [stored for stored in (record.blocks, record.scales) if stored not in found]
        if missing:
            report.problems.append(f"{name}: {' and '.join(missing)} not in the shared files")
            continue
        if name not in shared or ckpt.entries[name].shape != record.shape or len(record.shape) != 2:
            got = list(ckpt.entries[name].shape) if name in shared else "no such tensor"
            report.problems.append(f"{name}: the manifest says {list(record.shape)}, the source has {got}")
            continue
        problem = _check_dense_weight(root / found[record.blocks], root / found[record.scales], ckpt, name, record)
        if problem is not None:
            report.problems.append(f"{found[record.blocks]}: {problem}")
        report.shared_tensors_checked += 1


def _check_dense_weight(
    blocks_file: Path, scales_file: Path, ckpt: Checkpoint, name: str, record: DenseTensorRecord
) -> str | None:
    try:
        fmt = mx_format(record.format)
    except LayoutError as err:
        return str(err)
    with safe_open(str(blocks_file), framework="pt") as fb, safe_open(str(scales_file), framework="pt") as fs:
        blocks, scales = fb.get_slice(record.blocks), fs.get_slice(record.scales)
        return check_stored_weight(
            name,
            (record.shape[0], record.shape[1]),
            fmt,
            lambda lo, hi: ckpt.read_rows(name, lo, hi),
            lambda lo, hi: blocks[:, lo:hi, :],
            lambda lo, hi: scales[:, lo:hi],
        )

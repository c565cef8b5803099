"""``prepare``: plan first (validated, printable, nothing written), then one streaming pass.

Each layer's experts are read once, in chunks of experts, and every rank's file for that layer
is filled from the same chunk, so ``--tp 8`` reads the source once and memory stays at a chunk
plus its outputs whatever the model size. Files are written under temporary names, renamed
when complete, hashed, and recorded in a journal; the manifest comes last.

The journal is the first file a run writes (after taking the folder's lock), so a run killed at any
instant leaves a folder that the same command resumes, and that a run of another plan refuses
with what differs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from prepkit import __version__
from prepkit.allocator import keep_freed_memory
from prepkit.checkpoint import Checkpoint
from prepkit.constants import (
    FETCH_RECORD,
    INDEX_NAME,
    JOURNAL_NAME,
    MANIFEST_NAME,
    PREPARE_LOCK,
    SHARED_DIR,
    SYNTH_RECORD,
)
from prepkit.errors import CheckpointError, FetchError, OutputError, VerifyError
from prepkit.fetch import read_fetch_record
from prepkit.fsutil import (
    crash_point,
    free_bytes,
    fsync_dir,
    make_dirs,
    temp_path,
    temp_writer_pid,
)
from prepkit.layouts import Layout, LayoutOptions, RankPlan, RankSpec
from prepkit.layouts.base import SOURCE_ROLES
from prepkit.locks import exclusive, holder_pid, is_held
from prepkit.manifest import (
    FETCHED,
    LOCAL,
    SYNTHESIZED,
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
from prepkit.recipes import Recipe
from prepkit.shards import (
    Journal,
    WrittenFile,
    link_or_copy,
    safetensors_header,
    sha256_file,
    write_json_atomic,
    write_safetensors,
)
from prepkit.synth import read_synth_record

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int], None]
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
    shared_groups: list[list[str]]
    expert_source_bytes: int
    shared_bytes: int
    output_bytes_per_rank: list[int]
    free_bytes: int
    fingerprint: str
    warnings: list[str] = field(default_factory=list)
    chunk_bytes: int = CHUNK_BYTES
    identity: dict[str, Any] = field(default_factory=dict)  # what the fingerprint hashes, spelled out

    @property
    def bytes_to_write(self) -> int:
        return sum(self.output_bytes_per_rank) + self.shared_bytes

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.recipe.name,
            "source": str(self.checkpoint.root),
            "out": str(self.out_dir),
            "layout": self.layout.name,
            "layout_id": self.layout.layout_id,
            "options": _used_options(self),
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
            "bytes_to_write": self.bytes_to_write,
            "free_bytes": self.free_bytes,
            "warnings": self.warnings,
        }


def _used_options(plan: PreparePlan) -> dict[str, Any]:
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
) -> PreparePlan:
    """Validate the source and the split, and decide every byte's place; writes nothing.

    Raises CheckpointError (bad source), LayoutError (a split that does not fit),
    OutputError (foreign output folder, not enough disk).
    """
    options = options or LayoutOptions()
    if tp_size < 1 or ep_size < 1:
        raise OutputError(f"--tp and --ep must be at least 1 (got tp={tp_size}, ep={ep_size})")
    checkpoint = Checkpoint(src, recipe)
    checkpoint.validate()
    dims = checkpoint.dims
    specs = RankSpec.all_ranks(tp_size, ep_size)
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= r < len(specs)]
        if bad:
            raise OutputError(
                f"--rank {bad[0]} is out of range for tp={tp_size} x ep={ep_size}",
                hint=f"ranks are 0..{len(specs) - 1}",
            )
        specs = [specs[r] for r in sorted(set(ranks))]
    rank_plans = [layout.plan_rank(dims, spec, options) for spec in specs]

    warnings = layout.plan_warnings(dims, rank_plans, options)

    shared_names = checkpoint.non_expert_names()
    groups: list[list[str]] = [[]]
    used = 0
    for name in shared_names:
        size = checkpoint.entries[name].nbytes
        if groups[-1] and used + size > SHARED_FILE_BYTES:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    groups = [g for g in groups if g]
    shared_bytes = sum(checkpoint.entries[n].nbytes for n in shared_names)
    expert_bytes = sum(
        checkpoint.entries[n].nbytes for layer in range(dims.num_layers) for n in checkpoint.expert_names(layer)
    )
    per_rank = [p.layer_nbytes() * dims.num_layers for p in rank_plans]
    out_dir = Path(out_dir)
    identity = _plan_identity(checkpoint, layout, options, tp_size, ep_size, [p.spec.rank for p in rank_plans])
    fingerprint = _fingerprint(identity)
    lock = out_dir / PREPARE_LOCK
    if is_held(lock):
        raise _busy(out_dir)(holder_pid(lock))
    _check_output_dir(out_dir, fingerprint, identity)
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
    )
    return plan


def _plan_identity(
    checkpoint: Checkpoint, layout: Layout, options: LayoutOptions, tp: int, ep: int, ranks: list[int]
) -> dict[str, Any]:
    """Everything that decides the output bytes: a run resumes a folder only when all of it matches."""
    sources = []
    for path in checkpoint.source_files():
        st = path.stat()
        sources.append([path.name, st.st_size, st.st_mtime_ns])
    return {
        "prepkit": __version__,
        "layout": layout.layout_id,
        "options": dict(options.__dict__),
        "tp": tp,
        "ep": ep,
        "ranks": ranks,
        "sources": sources,
    }


def _fingerprint(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _busy(out_dir: Path) -> Callable[[int | None], OutputError]:
    def error(pid: int | None) -> OutputError:
        holder = f"pid {pid}" if pid else "another process"
        return OutputError(
            f"another prepkit prepare ({holder}) is writing {out_dir}; two runs never share a folder",
            hint="wait for it to finish (or stop it: a stopped run resumes), then rerun this command",
        )

    return error


def _finished_manifest(out_dir: Path) -> Manifest | None:
    """The manifest of an earlier finished run in ``out_dir``; None when there is none this
    version reads (the journal, or the folder's contents, decide then)."""
    if not (out_dir / MANIFEST_NAME).is_file():
        return None
    try:
        return Manifest.read(out_dir)
    except VerifyError:
        return None


def _check_output_dir(out_dir: Path, fingerprint: str, identity: dict[str, Any]) -> None:
    """Refuse a folder that is not empty, not this plan's finished output and not an unfinished run
    of this plan; say what differs when it holds another plan's."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise OutputError(f"--out {out_dir} is a file", hint="choose a folder")
    entries = sorted(p.name for p in out_dir.iterdir())
    if _only_leftovers(out_dir, entries):
        return  # empty, or a run killed before its journal: nothing in it is complete
    start_over = f"to start over, delete {out_dir} (or choose another output folder)"
    manifest = _finished_manifest(out_dir)
    if manifest is not None:
        if manifest.fingerprint == fingerprint:
            return
        differs = _differences(_manifest_identity(manifest), identity)
        raise OutputError(
            f"{out_dir} holds a different prepared shard set: " + "; ".join(differs),
            hint=f"rerun with its options to keep it; {start_over}",
        )
    if MANIFEST_NAME in entries and JOURNAL_NAME not in entries:
        raise OutputError(
            f"{out_dir / MANIFEST_NAME} cannot be read by prepkit {__version__} (damaged, or written by "
            "another version)",
            hint=start_over,
        )
    if JOURNAL_NAME in entries:
        journal_path = out_dir / JOURNAL_NAME
        try:
            journal = json.loads(journal_path.read_text())
            if not isinstance(journal, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as err:
            raise OutputError(
                f"{journal_path} (the journal of an unfinished run) cannot be read: {err}",
                hint=start_over,
            ) from err
        if journal.get("fingerprint") == fingerprint:
            return
        theirs = journal.get("plan")
        differs = _differences(theirs, identity) if isinstance(theirs, dict) and theirs else []
        started = (
            f" (started from {theirs['source_dir']})" if isinstance(theirs, dict) and "source_dir" in theirs else ""
        )
        raise OutputError(
            f"{out_dir} holds an unfinished run of another plan{started}: "
            + ("; ".join(differs) or "it was started by another prepkit version"),
            hint=f"rerun the command that started it to finish it; {start_over}",
        )
    foreign = [e for e in entries if not _is_prepkit_name(e)]
    if not foreign:
        raise OutputError(
            f"--out {out_dir} holds prepared files but neither {MANIFEST_NAME} nor a journal "
            f"(holds {', '.join(entries[:5])}): they cannot be trusted",
            hint=start_over,
        )
    raise OutputError(
        f"--out {out_dir} is not empty and is not a prepkit output folder (holds {', '.join(foreign[:5])})",
        hint="choose an empty or new folder",
    )


def _is_rank_dir(name: str) -> bool:
    return name.startswith("rank") and name[4:].isdigit()


def _is_prepkit_name(name: str) -> bool:
    """A name prepare writes at the top of its folder, besides the manifest and the journal."""
    return name in (PREPARE_LOCK, SHARED_DIR) or _is_rank_dir(name)


def _is_leftover(path: Path) -> bool:
    return path.is_file() and temp_writer_pid(path) is not None


def _only_leftovers(out_dir: Path, entries: list[str]) -> bool:
    """True when the folder holds nothing complete: at most the lock and temp files of killed runs
    (at the top, or in prepkit's own subfolders)."""
    for name in entries:
        path = out_dir / name
        if name == PREPARE_LOCK or _is_leftover(path):
            continue
        if (name == SHARED_DIR or _is_rank_dir(name)) and path.is_dir() and all(map(_is_leftover, path.iterdir())):
            continue
        return False
    return True


def _manifest_identity(manifest: Manifest) -> dict[str, Any]:
    """The part of a plan's identity a manifest records (sources by name and size, not mtime)."""
    return {
        "prepkit": manifest.prepkit_version,
        "layout": manifest.layout.id,
        "options": dict(manifest.layout.options),
        "tp": manifest.parallel.tp_size,
        "ep": manifest.parallel.ep_size,
        "ranks": [r.rank for r in manifest.ranks],
        "sources": [[name, f.bytes] for name, f in sorted(manifest.model.provenance.source_files.items())],
    }


def _differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """What a folder's plan (``theirs``) and this run's (``ours``) disagree on, option by option."""
    out = []
    for key, label in (("layout", "--layout"), ("tp", "--tp"), ("ep", "--ep"), ("ranks", "--rank")):
        if key in theirs and theirs[key] != ours.get(key):
            out.append(f"{label} is {theirs[key]} there, {ours.get(key)} here")
    their_options = theirs.get("options") or {}
    for name, value in sorted(their_options.items()):
        if value != ours.get("options", {}).get(name):
            out.append(f"--{name.replace('_', '-')} is {value} there, {ours['options'].get(name)} here")
    their_sources = {s[0]: tuple(s[1:]) for s in theirs.get("sources") or []}
    our_sources = {s[0]: tuple(s[1 : 1 + len(their_sources.get(s[0], ()))]) for s in ours.get("sources", [])}
    if "sources" in theirs:
        if set(their_sources) != set(our_sources):
            out.append(f"the source files are {sorted(their_sources)} there, {sorted(our_sources)} here")
        else:
            changed = sorted(n for n in their_sources if their_sources[n] != our_sources[n])
            if changed:
                out.append(f"source file(s) {', '.join(changed)} changed since (size or modification time)")
    if theirs.get("prepkit") not in (None, ours.get("prepkit")):
        out.append(f"it was written by prepkit {theirs['prepkit']}, this is prepkit {ours.get('prepkit')}")
    if not out:
        out.append("the source files' modification times differ (rewritten or copied since)")
    return out


# --- execution ---------------------------------------------------------------------------------


@dataclass
class PrepareResult:
    out_dir: Path
    files_written: int
    files_skipped: int
    bytes_written: int
    source_bytes_read: int
    seconds: float
    manifest: Manifest

    def summary(self) -> dict[str, Any]:
        return {
            "out": str(self.out_dir),
            "manifest": str(self.out_dir / MANIFEST_NAME),
            "files_written": self.files_written,
            "files_skipped": self.files_skipped,
            "bytes_written": self.bytes_written,
            "source_bytes_read": self.source_bytes_read,
            "seconds": round(self.seconds, 3),
            "source_gb_per_s": round(self.source_bytes_read / max(self.seconds, 1e-9) / 1e9, 3),
        }


class _RankFile:
    """One (rank, layer) safetensors file filled tensor region by region as chunks arrive."""

    def __init__(self, root: Path, rel: str, plan: RankPlan, prefix: str, metadata: dict[str, str]) -> None:
        self.rel = rel
        self.final = root / rel
        make_dirs(self.final.parent)
        self.tmp = temp_path(self.final)
        metas = {prefix + n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in plan.tensors.items()}
        header, order = safetensors_header(metas, metadata)
        self.offsets: dict[str, int] = {}
        self.per_expert: dict[str, int] = {}
        pos = len(header)
        for full in order:
            meta = metas[full]
            name = full[len(prefix) :]
            self.offsets[name] = pos
            self.per_expert[name] = meta[0].numel() * meta.element_size() if meta.shape[0] else 0
            pos += meta.numel() * meta.element_size()
        self.size = pos
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self.fd, self.size)
            os.pwrite(self.fd, header, 0)
        except OSError:
            self.abort()
            raise
        crash_point()

    def write_chunk(self, first_local_expert: int, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            data = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
            offset = self.offsets[name] + first_local_expert * self.per_expert[name]
            written = 0
            while written < len(data):
                written += os.pwrite(self.fd, data[written:], offset + written)
        crash_point()

    def commit_and_hash(self) -> str:
        """fsync, rename into place, then hash: runs on a worker thread, so the disk flush and
        the hash overlap the next layer's reading and shuffling."""
        try:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.final)
        except BaseException:
            self.abort()
            raise
        crash_point()
        fsync_dir(self.final.parent)
        return sha256_file(self.final)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


OUTPUT_TENSOR_BYTES = 24 * 1024 * 1024  # below the mmap threshold set by allocator.keep_freed_memory
IN_FLIGHT_CHUNKS = 2  # chunks the writer thread may hold before the main thread waits for it


def _chunks(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    return [(e, min(e + step, hi)) for e in range(lo, hi, step)]


def _experts_per_chunk(plan: PreparePlan, per_expert_source: int) -> int:
    """Experts per step: bounded by the source bytes read per step, and small enough that every
    output tensor of one rank stays under the allocator's mmap threshold (reused, not faulted)."""
    largest = max(t.nbytes // max(t.shape[0], 1) for p in plan.ranks for t in p.tensors.values())
    return max(1, min(plan.chunk_bytes // max(per_expert_source, 1), OUTPUT_TENSOR_BYTES // max(largest, 1)))


def prepare(plan: PreparePlan, on_progress: ProgressFn | None = None) -> PrepareResult:
    """Run the plan; resumes from the journal; returns what was done. Raises OutputError on I/O."""
    # One intra-op thread: the shuffles are cheap next to the writes and hashes, which run on
    # their own threads; torch's pool on top of them oversubscribes the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _prepare(plan, on_progress)
    finally:
        torch.set_num_threads(threads)


def _prepare(plan: PreparePlan, on_progress: ProgressFn | None) -> PrepareResult:
    started = time.perf_counter()
    root = plan.out_dir
    try:
        make_dirs(root)
        crash_point()
        with exclusive(root / PREPARE_LOCK, busy=_busy(root)):
            crash_point()
            # Planning looked at the folder before the lock was ours: look again.
            _check_output_dir(root, plan.fingerprint, plan.identity)
            _remove_leftovers(root)
            journal = _resume_journal(plan)
            journal.save()  # before any output file: from here on the folder is this plan's
            run = _Run(plan, journal, on_progress)
            try:
                hashes = {p.name: run.hasher.pool.submit(sha256_file, p) for p in _sources_to_hash(plan.checkpoint)}
                run.write_shared_files()
                run.write_expert_layers()
            finally:
                run.shutdown()
            manifest = _finish(plan, run.files, {name: fut.result() for name, fut in hashes.items()})
    except OSError as err:
        full = err.errno == errno.ENOSPC
        raise OutputError(
            f"writing {err.filename or root} failed: {err.strerror or err}",
            hint=("free disk space" if full else "make it a writable folder") + ", then rerun: finished files are kept",
        ) from err
    seconds = time.perf_counter() - started
    return PrepareResult(root, run.written, run.skipped, run.bytes_written, run.source_read, seconds, manifest)


def _remove_leftovers(root: Path) -> None:
    """Delete the temp files of killed runs: never complete, never kept. Only called under the
    folder's lock, so every process that named a temp file here is gone."""
    for leftover in root.glob("**/*.tmp-*"):
        if temp_writer_pid(leftover) is not None and leftover.is_file():
            leftover.unlink(missing_ok=True)
            fsync_dir(leftover.parent)


def _resume_journal(plan: PreparePlan) -> Journal:
    """The files an earlier run of this plan finished: from its journal, or, when it got as far as
    the manifest, from that."""
    journal = Journal.load(plan.out_dir, plan.fingerprint, {**plan.identity, "source_dir": str(plan.checkpoint.root)})
    finished = _finished_manifest(plan.out_dir)
    if finished is not None:
        journal.files = {
            rel: WrittenFile(rel, h.sha256, h.bytes)
            for rel, h in finished.files.items()
            if rel.endswith(".safetensors")
        }
    return journal


class _ChunkWriter:
    """One thread that copies built chunks into rank files (and blocks on a slow disk) while the
    main thread reads and shuffles the next chunk."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.in_flight: list[Future[None]] = []

    def submit(self, out: _RankFile, first_local_expert: int, tensors: dict[str, torch.Tensor]) -> None:
        while len(self.in_flight) >= IN_FLIGHT_CHUNKS:
            self.in_flight.pop(0).result()
        self.in_flight.append(self.pool.submit(out.write_chunk, first_local_expert, tensors))

    def finish(self) -> None:
        """Wait for every chunk; raises the first failure."""
        while self.in_flight:
            self.in_flight.pop(0).result()

    def cancel(self) -> None:
        for fut in self.in_flight:
            fut.cancel()
        wait(self.in_flight)
        self.in_flight.clear()


class _FileHasher:
    """Two threads that fsync, rename and hash finished rank files, overlapping the next layer's
    work; each result is recorded in the journal as it is collected."""

    def __init__(self, journal: Journal, files: dict[str, WrittenFile]) -> None:
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.journal = journal
        self.files = files
        self.pending: list[tuple[Future[str], str, int]] = []

    def commit(self, out: _RankFile) -> None:
        self.pending.append((self.pool.submit(out.commit_and_hash), out.rel, out.size))

    def is_committing(self, rel: str) -> bool:
        return any(rel == pending_rel for _, pending_rel, _ in self.pending)

    def collect(self, block: bool) -> None:
        """Record the finished hashes (all of them when ``block``); raises the first failure."""
        keep = []
        for fut, rel, size in self.pending:
            if block or fut.done():
                written = WrittenFile(rel, fut.result(), size)
                self.files[rel] = written
                self.journal.record(written)
            else:
                keep.append((fut, rel, size))
        self.pending = keep


class _Run:
    """One streaming pass over the plan: the counters, the journal and the worker threads."""

    def __init__(self, plan: PreparePlan, journal: Journal, on_progress: ProgressFn | None) -> None:
        self.plan = plan
        self.ckpt = plan.checkpoint
        self.journal = journal
        self.progress = on_progress or (lambda label, done, total: None)
        self.files: dict[str, WrittenFile] = {}
        self.writer = _ChunkWriter()
        self.hasher = _FileHasher(journal, self.files)
        self.written = self.skipped = self.bytes_written = self.source_read = 0
        self.total_source = plan.expert_source_bytes + plan.shared_bytes
        self.done_source = 0
        self.rank_total = {p.spec.rank: n for p, n in zip(plan.ranks, plan.output_bytes_per_rank, strict=False)}
        self.rank_done = dict.fromkeys(self.rank_total, 0)

    def shutdown(self) -> None:
        self.writer.pool.shutdown(wait=True)
        self.hasher.pool.shutdown(wait=True)

    def _reuse(self, rel: str) -> None:
        self.files[rel] = self.journal.files[rel]
        self.skipped += 1

    def write_shared_files(self) -> None:
        """Non-expert tensors: carried through unchanged, written once, shared by every rank."""
        metadata = {"format": "pt", "producer": f"prepkit {__version__}"}
        for i, names in enumerate(self.plan.shared_groups):
            rel = shared_file(i)
            group_bytes = sum(self.ckpt.entries[n].nbytes for n in names)
            if self.journal.is_done(rel):
                self._reuse(rel)
            else:
                written = write_safetensors(self.plan.out_dir, rel, {n: self.ckpt.read(n) for n in names}, metadata)
                self.source_read += group_bytes
                self.files[rel] = written
                self.journal.record(written)
                self.written += 1
                self.bytes_written += written.bytes
            self.done_source += group_bytes
            self.progress("source", self.done_source, self.total_source)

    def write_expert_layers(self) -> None:
        """Every layer's experts, in chunks read once into reused buffers, into every rank's file."""
        dims = self.ckpt.dims
        per_expert_source = sum(self.ckpt.entries[n].nbytes for n in self.ckpt.expert_names(0)) // dims.num_experts
        step = _experts_per_chunk(self.plan, per_expert_source)
        with keep_freed_memory():
            buffers = {
                role: torch.empty(
                    step * self.ckpt.entries[self.ckpt.recipe.expert_name(0, role)].nbytes // dims.num_experts,
                    dtype=torch.uint8,
                )
                for role in SOURCE_ROLES
            }
            for layer in range(dims.num_layers):
                self.write_layer(layer, step, buffers)
                # at most about two layers' files wait for their hashes
                self.hasher.collect(block=len(self.hasher.pending) > 2 * len(self.plan.ranks))
            self.hasher.collect(block=True)

    def write_layer(self, layer: int, step: int, buffers: dict[str, torch.Tensor]) -> None:
        """One layer's file of every rank not finished yet; the files go to the hasher."""
        layer_source = sum(self.ckpt.entries[n].nbytes for n in self.ckpt.expert_names(layer))
        todo = []
        for p in self.plan.ranks:
            rel = experts_file(p.spec.rank, layer)
            if self.journal.is_done(rel):
                self._reuse(rel)
            else:
                todo.append(p)
        if todo:
            prefix = self.plan.recipe.output_expert_prefix(layer)
            metadata = {"format": "pt", "producer": f"prepkit {__version__}", "layout": self.plan.layout.layout_id}
            outs = {
                p.spec.rank: _RankFile(self.plan.out_dir, experts_file(p.spec.rank, layer), p, prefix, metadata)
                for p in todo
            }
            try:
                self._fill(layer, layer_source, step, buffers, todo, outs)
            except BaseException:
                self.writer.cancel()
                for out in outs.values():
                    if not self.hasher.is_committing(out.rel):
                        out.abort()
                raise
        self.done_source += layer_source
        self.progress("source", self.done_source, self.total_source)

    def _fill(
        self,
        layer: int,
        layer_source: int,
        step: int,
        buffers: dict[str, torch.Tensor],
        todo: list[RankPlan],
        outs: dict[int, _RankFile],
    ) -> None:
        """Read the layer chunk by chunk; build and write every rank's part of each chunk."""
        num_experts = self.ckpt.dims.num_experts
        # Chunks never straddle an EP boundary, so each chunk feeds whole ranks.
        for e_lo, e_hi in sorted({p.expert_range for p in todo}):
            owners = [p for p in todo if p.expert_range == (e_lo, e_hi)]
            for c_lo, c_hi in _chunks(e_lo, e_hi, step):
                weights = self.ckpt.read_experts_range(layer, c_lo, c_hi, buffers)
                self.source_read += weights.nbytes()
                for p in owners:
                    self.writer.submit(outs[p.spec.rank], c_lo - e_lo, self.plan.layout.build(weights, p))
                del weights
                self.progress("source", self.done_source + layer_source * c_hi // num_experts, self.total_source)
        self.writer.finish()
        for p in todo:
            out = outs[p.spec.rank]
            self.hasher.commit(out)
            self.written += 1
            self.bytes_written += out.size
            self.rank_done[p.spec.rank] += out.size
            self.progress(f"rank {p.spec.rank}", self.rank_done[p.spec.rank], self.rank_total[p.spec.rank])


def _finish(plan: PreparePlan, files: dict[str, WrittenFile], source_hashes: dict[str, str]) -> Manifest:
    """Link shared files into every rank, write rank indexes, then the manifest, last."""
    root = plan.out_dir
    ckpt = plan.checkpoint
    link_method = "none"
    rank_entries = []
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
                weight_map[n] = Path(rel).name
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
        files[f"rank{r}/{INDEX_NAME}"] = write_json_atomic(root, f"rank{r}/{INDEX_NAME}", index)
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
    manifest = Manifest(
        prepkit_version=__version__,
        fingerprint=plan.fingerprint,
        layout=LayoutRecord(
            name=plan.layout.name,
            id=plan.layout.layout_id,
            w13_row_order=plan.layout.w13_row_order,
            options=_used_options(plan),
        ),
        model=ModelRecord(
            recipe=plan.recipe.name,
            repo_id=plan.recipe.repo_id,
            revision=plan.recipe.revision,
            dims=ckpt.dims,
            config=ckpt.config,
            provenance=_provenance(ckpt, source_hashes),
        ),
        parallel=Parallel(tp_size=plan.tp_size, ep_size=plan.ep_size),
        expert_tensor_prefix=plan.recipe.expert_prefix,
        shared_files=tuple(shared_file(i) for i in range(len(plan.shared_groups))),
        shared_file_link=link_method,
        ranks=tuple(rank_entries),
        files={rel: FileHash(wf.sha256, wf.bytes) for rel, wf in sorted(files.items())},
    )
    write_json_atomic(root, MANIFEST_NAME, manifest.to_json())
    Journal(root, plan.fingerprint).remove()
    return manifest


@dataclass(frozen=True)
class _SourceRecord:
    """The record of whoever wrote the source folder (``prepkit fetch``, else ``prepkit synth``):
    the hashes it vouches for, and the provenance the manifest cites (without file hashes)."""

    files: dict[str, tuple[int, str]]  # path -> (size, sha256) as recorded
    provenance: Provenance


def _source_record(ckpt: Checkpoint) -> _SourceRecord | None:
    """The fetch record, else the synth record; one that cannot be read is ignored with a warning
    (its files are hashed again instead)."""
    try:
        fetched = read_fetch_record(ckpt.root)
    except FetchError as err:
        log.warning("ignoring %s: %s", ckpt.root / FETCH_RECORD, err)
        fetched = None
    if fetched is not None:
        return _SourceRecord(
            {e.path: (e.size, e.sha256) for e in fetched.entries},
            Provenance(
                FETCHED,
                source_repo=fetched.repo_id,
                source_revision=fetched.revision,
                source_commit=fetched.commit,
                fetched_at=fetched.fetched_at,
                fetch_record=FETCH_RECORD,
            ),
        )
    try:
        synthesized = read_synth_record(ckpt.root)
    except CheckpointError as err:
        log.warning("ignoring %s: %s", ckpt.root / SYNTH_RECORD, err)
        synthesized = None
    if synthesized is not None:
        return _SourceRecord(
            {f.path: (f.size, f.sha256) for f in synthesized.files},
            Provenance(SYNTHESIZED, synth_record=SYNTH_RECORD, seed=synthesized.seed),
        )
    return None


def _vouched_hashes(ckpt: Checkpoint, record: _SourceRecord | None) -> dict[str, str]:
    """The record's hashes of files whose size is still what the record says."""
    if record is None:
        return {}
    known = {}
    for rel, (size, sha256) in record.files.items():
        path = ckpt.root / rel
        # A file changed since the record was written (other size) is hashed again rather than trusted.
        if sha256 and path.is_file() and path.stat().st_size == size:
            known[rel] = sha256
    return known


def _sources_to_hash(ckpt: Checkpoint) -> list[Path]:
    """Source files whose sha256 no fetch or synth record vouches for."""
    known = _vouched_hashes(ckpt, _source_record(ckpt))
    return [p for p in ckpt.source_files() if p.name not in known]


def _provenance(ckpt: Checkpoint, source_hashes: dict[str, str]) -> Provenance:
    """Source revision and file hashes: from the fetch record when the model came through
    ``prepkit fetch`` (verified against the hub there), else hashed during the run."""
    record = _source_record(ckpt)
    known = _vouched_hashes(ckpt, record)
    source_files = {
        p.name: FileHash(known.get(p.name) or source_hashes.get(p.name) or sha256_file(p), p.stat().st_size)
        for p in ckpt.source_files()
    }
    cited = record.provenance if record else Provenance(LOCAL)
    return replace(cited, source_files=source_files)

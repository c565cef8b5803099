"""The write engine: one streaming pass that reads each layer's experts once, in chunks, fills
every rank's file from the same chunk on a writer thread, and hashes finished files on two more,
recording each in the journal."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from prepkit import __version__
from prepkit.allocator import keep_freed_memory
from prepkit.constants import DENSE_MX_LAYOUT_ID
from prepkit.fsutil import crash_point, fsync_dir, make_dirs, sha256_file, temp_path
from prepkit.layouts import RankPlan
from prepkit.layouts.base import SOURCE_ROLES
from prepkit.layouts.dense_mx import mx_format
from prepkit.manifest import experts_file, shared_file
from prepkit.prepare.dense import is_quantized, quantize_weight
from prepkit.prepare.plan import PreparePlan
from prepkit.shards import Journal, WrittenFile, safetensors_header, write_safetensors

ProgressFn = Callable[[str, int, int], None]


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
            data = t.contiguous().reshape(-1).view(torch.uint8).numpy().data.cast("B")
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


class WritePass:
    """One streaming pass over the plan: the counters, the journal and the worker threads."""

    def __init__(
        self, plan: PreparePlan, journal: Journal, on_progress: ProgressFn | None, quantize_threads: int = 1
    ) -> None:
        self.plan = plan
        # MX quantization is compute, with no writer or hasher beside it yet: torch's whole pool.
        self.quantize_threads = quantize_threads
        self.ckpt = plan.checkpoint
        self.journal = journal
        self.progress = on_progress or (lambda label, done, total: None)
        self.files: dict[str, WrittenFile] = {}
        self.writer = _ChunkWriter()
        self.hasher = _FileHasher(journal, self.files)
        self.written = self.skipped = self.bytes_written = self.source_read = 0
        self.total_source = plan.expert_source_bytes + plan.shared_source_bytes
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
        """Non-expert tensors, written once and shared by every rank: carried through unchanged, but
        for the dense weights under an MX ``--dense``, each quantized into its two stored tensors."""
        metadata = {"format": "pt", "producer": f"prepkit {__version__}"}
        if self.plan.quantized_names():
            metadata |= {"dense_format": self.plan.dense, "dense_layout": DENSE_MX_LAYOUT_ID}
        for i, names in enumerate(self.plan.shared_groups):
            rel = shared_file(i)
            group_bytes = sum(self.ckpt.entries[n].nbytes for n in names)
            if self.journal.is_done(rel):
                self._reuse(rel)
            else:
                written = write_safetensors(self.plan.out_dir, rel, self._shared_tensors(names), metadata)
                self.source_read += group_bytes
                self.files[rel] = written
                self.journal.record(written)
                self.written += 1
                self.bytes_written += written.bytes
            self.done_source += group_bytes
            self.progress("source", self.done_source, self.total_source)

    def _shared_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """One shared file's tensors by output name; MX dense weights are quantized one at a time
        (each a slice of rows at a time), with progress after each."""
        tensors: dict[str, torch.Tensor] = {}
        done = self.done_source
        for n in names:
            if is_quantized(n, self.plan.dense):
                threads = torch.get_num_threads()
                torch.set_num_threads(self.quantize_threads)
                try:
                    tensors.update(quantize_weight(self.ckpt, n, mx_format(self.plan.dense)))
                finally:
                    torch.set_num_threads(threads)
                done += self.ckpt.entries[n].nbytes
                self.progress("source", done, self.total_source)
            else:
                tensors[n] = self.ckpt.read(n)
                done += self.ckpt.entries[n].nbytes
        return tensors

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

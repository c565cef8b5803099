"""``prepare``'s run: under the folder's lock, resume from the journal, stream every file, then
the indexes and the manifest."""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prepkit.constants import JOURNAL_NAME, MANIFEST_NAME, PREPARE_LOCK
from prepkit.errors import OutputError
from prepkit.fsutil import crash_point, make_dirs, sha256_file
from prepkit.locks import exclusive
from prepkit.manifest import Manifest
from prepkit.prepare.guard import (
    busy_error_for,
    check_output_dir,
    intact_finished_manifest,
    remove_leftovers,
    resume_journal,
)
from prepkit.prepare.manifest_build import write_indexes_and_manifest
from prepkit.prepare.plan import PreparePlan
from prepkit.prepare.provenance import read_source_record, source_provenance, vouched_hashes
from prepkit.prepare.write import ProgressFn, WritePass
from prepkit.shards import Journal


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


def prepare(plan: PreparePlan, on_progress: ProgressFn | None = None) -> PrepareResult:
    """Run the plan; resumes from the journal; returns what was done. Raises OutputError on I/O."""
    # One intra-op thread: the shuffles are cheap next to the writes and hashes, which run on
    # their own threads; torch's pool on top of them oversubscribes the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _prepare(plan, on_progress, quantize_threads=threads)
    finally:
        torch.set_num_threads(threads)


def _prepare(plan: PreparePlan, on_progress: ProgressFn | None, quantize_threads: int = 1) -> PrepareResult:
    started = time.perf_counter()
    root = plan.out_dir
    try:
        make_dirs(root)
        crash_point()
        with exclusive(root / PREPARE_LOCK, busy=busy_error_for(root)):
            crash_point()
            # Planning looked at the folder before the lock was ours: look again.
            check_output_dir(root, plan.fingerprint, plan.identity)
            remove_leftovers(root)
            finished = intact_finished_manifest(root, plan.fingerprint)
            if finished is not None:
                # Nothing to do, and nothing written (not even a journal): a full disk reruns too.
                # A run killed between its manifest and the journal's removal left the journal.
                if (root / JOURNAL_NAME).exists():
                    Journal(root, plan.fingerprint).remove()
                done = len(plan.planned_files())
                return PrepareResult(root, 0, done, 0, 0, time.perf_counter() - started, finished)
            identity = {**plan.identity, "source_dir": str(plan.checkpoint.root)}
            journal = resume_journal(plan.out_dir, plan.fingerprint, identity, plan.planned_files())
            journal.save()  # before any output file: from here on the folder is this plan's
            run = WritePass(plan, journal, on_progress, quantize_threads)
            # The source record is read once: its hashes spare hashing those files, and it is cited.
            record = read_source_record(plan.checkpoint)
            vouched = vouched_hashes(plan.checkpoint, record)
            try:
                hashes = {
                    p.name: run.hasher.pool.submit(sha256_file, p)
                    for p in plan.checkpoint.source_files()
                    if p.name not in vouched
                }
                run.write_shared_files()
                run.write_expert_layers()
            finally:
                run.shutdown()
            taken = {name: fut.result() for name, fut in hashes.items()}
            provenance = source_provenance(plan.checkpoint, record, vouched | taken)
            manifest = write_indexes_and_manifest(plan, run.files, provenance)
    except OSError as err:
        full = err.errno == errno.ENOSPC
        raise OutputError(
            f"writing {err.filename or root} failed: {err.strerror or err}",
            hint=("free disk space" if full else "make it a writable folder") + ", then rerun: finished files are kept",
        ) from err
    seconds = time.perf_counter() - started
    return PrepareResult(root, run.written, run.skipped, run.bytes_written, run.source_read, seconds, manifest)

"""Where the source came from: the record of whoever wrote the source folder (``prepkit fetch``,
else ``prepkit synth``), read once per run, whose hashes spare hashing those files again, and the
provenance the manifest cites."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from prepkit.checkpoint import Checkpoint
from prepkit.constants import FETCH_RECORD, SYNTH_RECORD
from prepkit.errors import CheckpointError, FetchError
from prepkit.fetch import read_fetch_record
from prepkit.fsutil import sha256_file
from prepkit.manifest import FETCHED, LOCAL, SYNTHESIZED, FileHash, Provenance
from prepkit.synth import read_synth_record

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceRecord:
    """The record of whoever wrote the source folder (``prepkit fetch``, else ``prepkit synth``):
    the hashes it vouches for, and the provenance the manifest cites (without file hashes)."""

    files: dict[str, tuple[int, str]]  # path -> (size, sha256) as recorded
    provenance: Provenance


def read_source_record(ckpt: Checkpoint) -> SourceRecord | None:
    """The fetch record, else the synth record; one that cannot be read is ignored with a warning
    (its files are hashed again instead)."""
    try:
        fetched = read_fetch_record(ckpt.root)
    except FetchError as err:
        log.warning("ignoring %s: %s", ckpt.root / FETCH_RECORD, err)
        fetched = None
    if fetched is not None:
        return SourceRecord(
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
        return SourceRecord(
            {f.path: (f.size, f.sha256) for f in synthesized.files},
            Provenance(SYNTHESIZED, synth_record=SYNTH_RECORD, seed=synthesized.seed),
        )
    return None


def vouched_hashes(ckpt: Checkpoint, record: SourceRecord | None) -> dict[str, str]:
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


def source_provenance(ckpt: Checkpoint, record: SourceRecord | None, hashes: dict[str, str]) -> Provenance:
    """What the manifest cites of the source: the record's revision (``prepkit fetch``, verified
    against the hub there) or seed (``prepkit synth``), else a local folder; and every source file
    with its sha256 from ``hashes`` (the record's vouched ones and those taken during the run)."""
    source_files = {
        p.name: FileHash(hashes.get(p.name) or sha256_file(p), p.stat().st_size) for p in ckpt.source_files()
    }
    cited = record.provenance if record else Provenance(LOCAL)
    return replace(cited, source_files=source_files)

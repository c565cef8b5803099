"""The output folder's guard: what identifies a plan (so a run resumes only its own unfinished
folder), the refusal of any other folder with what differs, the busy error, and the cleanup of
killed runs' temp files under the lock."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from prepkit import __version__
from prepkit.checkpoint import Checkpoint
from prepkit.constants import DEFAULT_DENSE_FORMAT, JOURNAL_NAME, MANIFEST_NAME, PREPARE_LOCK, SHARED_DIR
from prepkit.errors import OutputError, VerifyError
from prepkit.fsutil import fsync_dir, sha256_file, temp_writer_pid
from prepkit.layouts import Layout, LayoutOptions
from prepkit.locks import busy_error
from prepkit.manifest import Manifest
from prepkit.model_files import is_model_file
from prepkit.shards import Journal, WrittenFile


def plan_identity(
    checkpoint: Checkpoint,
    layout: Layout,
    options: LayoutOptions,
    tp: int,
    ep: int,
    ranks: list[int],
    dense: str = DEFAULT_DENSE_FORMAT,
) -> dict[str, Any]:
    """Everything that decides the output bytes: a run resumes a folder only when all of it matches."""
    sources = []
    for path in checkpoint.source_files():
        st = path.stat()
        sources.append([path.name, st.st_size, st.st_mtime_ns])
    identity = {
        "prepkit": __version__,
        "layout": layout.layout_id,
        "options": dict(options.__dict__),
        "tp": tp,
        "ep": ep,
        "ranks": ranks,
        "sources": sources,
    }
    if dense != DEFAULT_DENSE_FORMAT:  # absent for bf16: the fingerprint of a bf16 plan stays as it was
        identity["dense"] = dense
    return identity


def fingerprint_of(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def busy_error_for(out_dir: Path) -> Callable[[int | None], OutputError]:
    """The error a second run on ``out_dir`` gets, given the holder's pid."""

    def error(pid: int | None) -> OutputError:
        return busy_error(
            OutputError,
            pid,
            command="prepkit prepare",
            target=out_dir,
            detail="; two runs never share a folder",
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


def check_output_dir(out_dir: Path, fingerprint: str, identity: dict[str, Any]) -> None:
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
    return name in (PREPARE_LOCK, SHARED_DIR) or _is_rank_dir(name) or is_model_file(name)


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
        "dense": manifest.dense_format,
    }


def _differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """What a folder's plan (``theirs``) and this run's (``ours``) disagree on, option by option."""
    out = []
    for key, label in (("layout", "--layout"), ("tp", "--tp"), ("ep", "--ep"), ("ranks", "--rank")):
        if key in theirs and theirs[key] != ours.get(key):
            out.append(f"{label} is {theirs[key]} there, {ours.get(key)} here")
    their_dense, our_dense = (side.get("dense", DEFAULT_DENSE_FORMAT) for side in (theirs, ours))
    if their_dense != our_dense:
        out.append(f"--dense is {their_dense} there, {our_dense} here")
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


def remove_leftovers(root: Path) -> None:
    """Delete the temp files of killed runs: never complete, never kept. Only called under the
    folder's lock, so every process that named a temp file here is gone."""
    for leftover in root.glob("**/*.tmp-*"):
        if temp_writer_pid(leftover) is not None and leftover.is_file():
            leftover.unlink(missing_ok=True)
            fsync_dir(leftover.parent)


def finished_files(out_dir: Path, fingerprint: str, planned: Mapping[str, int] | None = None) -> set[str]:
    """The output files an earlier run of this plan finished (per its manifest, else its journal,
    else complete under their final names: see :func:`unrecorded_files`) that still have their
    size: what a resume will not write again. Sizes only, no hashes: this sizes the free-space
    check, and the run checks each hash before trusting a file. ``planned``: the plan's tensor
    files with their tensor bytes."""
    manifest = _finished_manifest(out_dir)
    if manifest is not None and manifest.fingerprint == fingerprint:
        recorded = {rel: h.bytes for rel, h in manifest.files.items()}
    else:
        recorded = {rel: f.bytes for rel, f in Journal.load(out_dir, fingerprint).files.items()}
    finished = {rel for rel, size in recorded.items() if _has_size(out_dir / rel, size)}
    return finished | set(unrecorded_files(out_dir, fingerprint, planned or {}, set(recorded)))


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.is_file() and path.stat().st_size == size
    except OSError:
        return False


def _journal_fingerprint(out_dir: Path) -> str | None:
    try:
        raw = json.loads((out_dir / JOURNAL_NAME).read_text())
    except (OSError, ValueError):
        return None
    return raw.get("fingerprint") if isinstance(raw, dict) else None


def _safetensors_data_bytes(path: Path) -> int | None:
    """The bytes after a safetensors file's header (None when it has no readable header)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(head) < 8:
        return None
    (header_len,) = struct.unpack("<Q", head)
    return size - 8 - header_len if 8 + header_len <= size else None


def unrecorded_files(out_dir: Path, fingerprint: str, planned: Mapping[str, int], recorded: set[str]) -> dict[str, int]:
    """Tensor files of this plan complete under their final names but missing from the journal
    (the disk filled, or the run died, between a file's rename and the journal's rewrite), by path
    with their size. A file gets its final name only once whole and synced, and the journal,
    written before any output file, ties the folder to this plan: such a file is adopted, not
    written again."""
    if _journal_fingerprint(out_dir) != fingerprint:
        return {}
    found = {}
    for rel, tensor_bytes in planned.items():
        path = out_dir / rel
        if rel in recorded or path.is_symlink() or not path.is_file():
            continue
        if _safetensors_data_bytes(path) == tensor_bytes:
            found[rel] = path.stat().st_size
    return found


def intact_finished_manifest(out_dir: Path, fingerprint: str) -> Manifest | None:
    """This plan's manifest when the folder is finished and whole: every file it lists has its
    size and sha256, and every rank folder links the shared files. A rerun then writes nothing."""
    manifest = _finished_manifest(out_dir)
    if manifest is None or manifest.fingerprint != fingerprint:
        return None
    try:
        for rel, recorded in manifest.files.items():
            path = out_dir / rel
            if not _has_size(path, recorded.bytes) or sha256_file(path) != recorded.sha256:
                return None
        for record in manifest.ranks:
            for local, shared in zip(manifest.rank_shared_files(record.rank), manifest.shared_files, strict=True):
                if not os.path.samefile(out_dir / local, out_dir / shared):
                    return None
    except (OSError, VerifyError):
        return None
    return manifest


def resume_journal(out_dir: Path, fingerprint: str, identity: dict[str, Any], planned_files: dict[str, int]) -> Journal:
    """The files an earlier run of a plan (its output folder, fingerprint, identity and planned
    file sizes) finished: from its journal, or, when it got as far as the manifest, from that;
    files complete under their final names that the journal missed are hashed and adopted
    (:func:`unrecorded_files`)."""
    journal = Journal.load(out_dir, fingerprint, identity)
    finished = _finished_manifest(out_dir)
    if finished is not None:
        journal.files = {
            rel: WrittenFile(rel, h.sha256, h.bytes)
            for rel, h in finished.files.items()
            if rel.endswith(".safetensors")
        }
    adopted = unrecorded_files(out_dir, fingerprint, planned_files, set(journal.files))
    for rel, size in adopted.items():
        journal.files[rel] = WrittenFile(rel, sha256_file(out_dir / rel), size)
    return journal

"""The fetch record, ``prepkit-fetch.json``: written last, once every file is verified, it names the
repo, the exact commit and every file with its hash; ``prepare`` cites it as provenance."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prepkit import __version__
from prepkit.constants import FETCH_RECORD
from prepkit.errors import FetchError
from prepkit.fetch.source import RemoteFile, Source
from prepkit.fsutil import write_json_atomic

if TYPE_CHECKING:
    from prepkit.fetch.plan import FetchPlan
    from prepkit.fetch.state import FetchState

RECORD_FORMAT = "prepkit-fetch/1"
REWRITE_HINT = "run `prepkit fetch` again to rewrite it"


@dataclass(frozen=True)
class RecordFile:
    path: str
    size: int
    sha256: str
    lfs: bool
    git_blob: str | None = None


@dataclass(frozen=True)
class FetchRecord:
    path: Path
    repo_id: str
    revision: str
    commit: str
    endpoint: str
    recipe: str | None
    include_original: bool
    fetched_at: str
    prepkit_version: str
    entries: tuple[RecordFile, ...]

    @property
    def files(self) -> tuple[RemoteFile, ...]:
        return tuple(
            RemoteFile(e.path, e.size, e.sha256 if e.lfs else None, None if e.lfs else e.git_blob) for e in self.entries
        )

    def matches(self, source: Source) -> bool:
        return self.repo_id == source.repo_id and source.revision in (self.revision, self.commit)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": RECORD_FORMAT,
            "prepkit_version": self.prepkit_version,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "endpoint": self.endpoint,
            "recipe": self.recipe,
            "include_original": self.include_original,
            "fetched_at": self.fetched_at,
            "total_bytes": sum(e.size for e in self.entries),
            "files": [
                {"path": e.path, "size": e.size, "sha256": e.sha256, "lfs": e.lfs}
                | ({} if e.lfs else {"git_blob": e.git_blob})
                for e in self.entries
            ],
        }


def read_fetch_record(model_dir: str | Path) -> FetchRecord | None:
    """The fetch record of ``model_dir``, or None when the folder was not (completely) fetched by prepkit.

    Raises:
        FetchError: the record exists but is not a prepkit fetch record this version can read.
    """
    path = Path(model_dir) / FETCH_RECORD
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise FetchError(f"{path} is unreadable: {err}", hint=REWRITE_HINT) from err
    try:
        if raw.get("format") != RECORD_FORMAT:
            raise ValueError(f"format is {raw.get('format')!r}, expected {RECORD_FORMAT!r}")
        entries = tuple(
            RecordFile(f["path"], int(f["size"]), f["sha256"], bool(f["lfs"]), f.get("git_blob")) for f in raw["files"]
        )
        keys = ("repo_id", "revision", "commit", "endpoint")
        head = {k: raw[k] for k in keys} | {
            "recipe": raw.get("recipe"),
            "include_original": bool(raw.get("include_original")),
        }
        return FetchRecord(
            path, **head, fetched_at=raw["fetched_at"], prepkit_version=raw["prepkit_version"], entries=entries
        )
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise FetchError(f"{path} is not a prepkit fetch record: {err}", hint=REWRITE_HINT) from err


def write_record(plan: FetchPlan, state: FetchState) -> FetchRecord:
    entries = []
    for f in plan.files:
        lfs = f.remote.sha256 is not None
        verified = state.verified[f.path]
        entries.append(
            RecordFile(f.path, f.remote.size, verified["sha256"], lfs, None if lfs else verified.get("git_blob"))
        )
    record = FetchRecord(
        path=plan.dest / FETCH_RECORD,
        repo_id=plan.source.repo_id,
        revision=plan.source.revision,
        commit=plan.commit,
        endpoint=plan.endpoint,
        recipe=plan.source.recipe,
        include_original=plan.include_original,
        fetched_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        prepkit_version=__version__,
        entries=tuple(entries),
    )
    write_json_atomic(record.path, record.to_json())
    return record

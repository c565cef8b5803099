"""Download a checkpoint from the Hugging Face hub: only the files ``prepare`` needs, at a pinned
commit, each checked against the hub's sha256 (or git blob id), plus a fetch record that ``prepare``
cites as provenance.

What is ours: which files (``source``), the plan with its disk check (``plan``), the verification
and its resume state (``state``), the record (``record``), ``--offline`` re-hashing, and one run from
lock to record (``run``). huggingface_hub moves the bytes, through its public API only (``hub``):
``snapshot_download`` does the parallel transfers, locks, atomic renames and the cache layout, so a
model fetched here is the one ``hf download`` and transformers see, and the other way round. Files
go to the Hugging Face cache, or with ``--local-dir`` to a plain folder; the record and the state lie
in that folder (``prepkit-fetch.json``, ``.cache/prepkit/``).
"""

from prepkit.fetch.cache import LOCK_PATH, STATE_PATH, default_model_dir, find_model_dir, model_dir_for
from prepkit.fetch.hub import TOTAL_LABEL, ProgressFn
from prepkit.fetch.plan import FetchPlan, PlannedFile, plan_fetch
from prepkit.fetch.record import FetchRecord, RecordFile, read_fetch_record
from prepkit.fetch.run import FetchResult, fetch
from prepkit.fetch.source import DEFAULT_EXCLUDE, DEFAULT_INCLUDE, RemoteFile, Source, resolve_source

__all__ = [
    "DEFAULT_EXCLUDE",
    "DEFAULT_INCLUDE",
    "LOCK_PATH",
    "STATE_PATH",
    "TOTAL_LABEL",
    "FetchPlan",
    "FetchRecord",
    "FetchResult",
    "PlannedFile",
    "ProgressFn",
    "RecordFile",
    "RemoteFile",
    "Source",
    "default_model_dir",
    "fetch",
    "find_model_dir",
    "model_dir_for",
    "plan_fetch",
    "read_fetch_record",
    "resolve_source",
]

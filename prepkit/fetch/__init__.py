"""Download a checkpoint from the Hugging Face hub: only the files ``prepare`` needs, at a pinned
commit, each checked against the hub's sha256 (or git blob id), plus a fetch record that ``prepare``
cites as provenance.

Ours: which files (``source``), the plan and its disk check (``plan``), the sha256 record and the
resume state in the same form (``record``), ``--offline`` re-hashing, and one run from lock to
record (``run``). huggingface_hub moves the bytes, through its public API only (``hub``):
``snapshot_download`` does the parallel transfers, locks, atomic renames and the cache layout, so a
model fetched here is the one ``hf download`` and transformers see, and the other way round.
"""

from prepkit.fetch.cache import default_model_dir, find_model_dir
from prepkit.fetch.hub import TOTAL_LABEL
from prepkit.fetch.plan import FetchPlan, plan_fetch
from prepkit.fetch.record import read_fetch_record
from prepkit.fetch.run import FetchResult, fetch
from prepkit.fetch.source import RemoteFile, Source, resolve_source

__all__ = [
    "TOTAL_LABEL",
    "FetchPlan",
    "FetchResult",
    "RemoteFile",
    "Source",
    "default_model_dir",
    "fetch",
    "find_model_dir",
    "plan_fetch",
    "read_fetch_record",
    "resolve_source",
]

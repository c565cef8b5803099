"""Download a checkpoint from the Hugging Face hub: only the files ``prepare`` needs, at a pinned
commit, each checked against the hub's sha256 (or git blob id), plus a fetch record that ``prepare``
cites as provenance.

Ours: which files (``source``), the plan and its disk check (``plan``), the sha256 record, which is
also the resume state (``record``), ``--offline`` re-hashing, and one run from lock to record
(``run``). huggingface_hub moves the bytes, through its public API only (``hub``): its
``snapshot_download`` does the parallel transfers, locks, atomic renames and the cache layout, so a
model fetched here is the one ``hf download`` and transformers see, and the other way round.
"""

from prepkit.fetch.cache import default_model_dir as default_model_dir
from prepkit.fetch.cache import find_model_dir as find_model_dir
from prepkit.fetch.hub import TOTAL_LABEL as TOTAL_LABEL
from prepkit.fetch.plan import FetchPlan as FetchPlan
from prepkit.fetch.plan import plan_fetch as plan_fetch
from prepkit.fetch.record import read_fetch_record as read_fetch_record
from prepkit.fetch.run import FetchResult as FetchResult
from prepkit.fetch.run import fetch as fetch
from prepkit.fetch.source import RemoteFile as RemoteFile
from prepkit.fetch.source import Source as Source
from prepkit.fetch.source import resolve_source as resolve_source

"""Download a checkpoint from the Hugging Face hub: only the files ``prepare`` needs, each one
checked against the hub's hashes, plus a fetch record that ``prepare`` cites as provenance.

huggingface_hub moves the bytes (``hf_hub_download``); this package adds what it leaves out for a
61 GiB download: a plan with a free-disk check, verification of every file (sha256 for LFS files,
the git blob id for small ones; the library only compares sizes), one retry of a file that fails
it, reuse of copies already on disk, cleanup of the partial files an interrupted run leaves behind
(huggingface_hub 2.x never resumes them), and a completeness check against the index.

Where the files go, by default the Hugging Face cache, huggingface_hub's own layout (so a model
already fetched with ``hf download`` is reused, and one fetched here is reused by everything that
reads the cache)::

    $HF_HUB_CACHE/models--<org>--<name>/blobs/<sha256 or git blob id>   the bytes
    $HF_HUB_CACHE/models--<org>--<name>/snapshots/<commit>/<repo path>   links to the blobs
    .../snapshots/<commit>/prepkit-fetch.json                             written last, when all is verified
    .../snapshots/<commit>/.cache/prepkit/fetch-state.json                plan + per-file verification

With ``--local-dir DIR`` (or a folder fetched by an earlier prepkit into ``$PREPKIT_HOME/models``) the
files are plain files at their repo paths in DIR, with the same record and state beside them and
huggingface_hub's bookkeeping under ``DIR/.cache/huggingface/``. Files already there (from ``hf
download --local-dir DIR``, say) are hashed and kept when they match.

By concern: ``source`` (what to fetch), ``cache`` (where models lie), ``plan``, ``state`` (resume),
``hashing``, ``record``, ``folder`` (lock, leftovers, refs), ``worker`` (download threads),
``progress``, ``hub_errors`` and ``run`` (one fetch, start to record).
"""

from prepkit.fetch.cache import (
    LOCK_PATH,
    STATE_PATH,
    RecipeLike,
    default_model_dir,
    find_model_dir,
    hub_cache_dir,
    model_dir_for,
    prepkit_home,
)
from prepkit.fetch.plan import FetchPlan, PlannedFile, plan_fetch
from prepkit.fetch.progress import TOTAL_LABEL, ProgressFn
from prepkit.fetch.record import FetchRecord, RecordFile, read_fetch_record
from prepkit.fetch.run import FetchResult, fetch
from prepkit.fetch.source import (
    DEFAULT_EXCLUDE,
    DEFAULT_INCLUDE,
    DEFAULT_ORIGINAL,
    RemoteFile,
    Source,
    resolve_source,
)

__all__ = [
    "DEFAULT_EXCLUDE",
    "DEFAULT_INCLUDE",
    "DEFAULT_ORIGINAL",
    "LOCK_PATH",
    "STATE_PATH",
    "TOTAL_LABEL",
    "FetchPlan",
    "FetchRecord",
    "FetchResult",
    "PlannedFile",
    "ProgressFn",
    "RecipeLike",
    "RecordFile",
    "RemoteFile",
    "Source",
    "default_model_dir",
    "fetch",
    "find_model_dir",
    "hub_cache_dir",
    "model_dir_for",
    "plan_fetch",
    "prepkit_home",
    "read_fetch_record",
    "resolve_source",
]

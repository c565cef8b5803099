"""``tactics.db`` as the tuner writes it (sqlite-utils): migrations, rows, merge and export.

Rows are content-addressed: environments, kernels, problems and tactics are keyed by a hash of
their canonical JSON (:mod:`prepkit.tactics.keys`), so two DBs filled on two machines merge
without renumbering. Writers use a rollback journal, a busy timeout and ``BEGIN IMMEDIATE``
transactions, so two tuners (two GPUs) writing one file wait for each other instead of failing or
losing rows, and a committed write is whole in the file itself: a writer killed after its commit
leaves no log that a read-only open (a DB baked into a container image) would have to apply. A
file found in WAL mode is switched back by the sole, else the last, writer.
The tables themselves are defined once, in :mod:`prepkit.tactics.schema`; the runtime reads them
with the standard library only (:mod:`prepkit.tactics.lookup`).

One module per concern: :mod:`.migrate` (opening and migrating), :mod:`.base` (the connection
and its write transaction), :mod:`.writes` (a tune's rows), :mod:`.reads` (resume reads and the
views), :mod:`.exchange` (checked copies of a source), :mod:`.merge` (merging one in),
:mod:`.db` (``TacticsDB``, its openers, the locked merge), :mod:`.recorder` (what a sweep
reports) and :mod:`.busy` (waiting on other writers, and write errors).
"""

from __future__ import annotations

from prepkit.tactics.store.busy import BUSY_TIMEOUT_S, write_failure
from prepkit.tactics.store.db import TacticsDB, merge_into, open_db, open_db_readonly
from prepkit.tactics.store.exchange import checked_copy
from prepkit.tactics.store.merge import MergeSummary
from prepkit.tactics.store.migrate import make_migrations
from prepkit.tactics.store.recorder import BatchRecord, ResultRecord, RowRecord, RunRecorder, WinnerRecord
from prepkit.tactics.store.writes import DecodeWinnerRow, WinnerRow, env_record

__all__ = [
    "BUSY_TIMEOUT_S",
    "BatchRecord",
    "DecodeWinnerRow",
    "MergeSummary",
    "ResultRecord",
    "RowRecord",
    "RunRecorder",
    "TacticsDB",
    "WinnerRecord",
    "WinnerRow",
    "checked_copy",
    "env_record",
    "make_migrations",
    "merge_into",
    "open_db",
    "open_db_readonly",
    "write_failure",
]

"""Which tactic serves a call: token ranges, where tables come from, and the resolver.

Contract for the MoE runtime (``prepkit.runtime.moe``)
-----------------------------------------------------
Build one :class:`~prepkit.tactics.keys.ProblemKey` per GEMM of a layer (``layer_problems``
does it from a rank's :class:`~prepkit.layer.RankLayer`), then either

* at load time: ``table = TacticTable.load(problem, device)``, and per call
  ``tactic = table.tactic_for(num_tokens)`` (O(1); ``None`` means "use your built-in default"),
  or ``table.get(num_tokens, default_fn)`` which returns the decoded ``GemmTactic``, or
* ad hoc: ``lookup_tactic(problem, num_tokens, device)`` which caches one table per problem
  and device in a module-level :class:`TacticResolver`.

``device`` is an :class:`Environment` or the kernels' ``prepkit.kernels.device.DeviceInfo``
(software versions are then read from the installed packages' metadata).

Where a table comes from, in order (first that has winners for the problem wins):

1. the user DB (``$PREPKIT_TACTICS_DB``, else ``$XDG_CACHE_HOME/prepkit/tactics.db``), rows
   measured with the same Triton minor version;
2. the bundled ``tactics.db`` (``prepkit/data/tactics.db`` in a wheel, the repository top in a checkout), same rule;
3. either DB with rows from another Triton minor version, only if the caller passed a
   ``smoke_check`` and it accepts every tactic of the table. The runtime's resolver
   (:func:`runtime_resolver`) accepts a table whose tactics all decode, warns once per GEMM, and
   the runtime falls back to the default for a variant that no longer compiles;
4. the built-in default (``None`` here): counted as a miss, with one warning per problem and
   device (and per runtime layer: :mod:`prepkit.warn_once`) that names the ``prepkit tune``
   command to run.

A row is never used when its compute capability differs from the device's, or its kernel name,
role, kernel version, weight layout or activation precision differs from the problem's (those are
part of the problem hash, so such rows simply do not match). Tactics in the blocklist for this
compute capability and Triton minor are dropped.

Token ranges use ceil semantics (:mod:`prepkit.tactics.ranges`, the one implementation of the
rule). Which variants then run, default and fix-ups included, is :func:`prepkit.tactics.choose.choose`.

This module gathers the lookup's parts under one name, each in its own module:
:mod:`~prepkit.tactics.points` (the token series), :mod:`~prepkit.tactics.ranges` (the range rule),
:mod:`~prepkit.tactics.paths` (where the DBs are), :mod:`~prepkit.tactics.table` (one problem's
table), :mod:`~prepkit.tactics.resolver` (the cache and its warnings),
:mod:`~prepkit.tactics.suggest` (the tune command a warning names) and
:mod:`~prepkit.tactics.adapters` (the runtime's lookups). Standard library only, so
``import prepkit.runtime`` stays cheap.
"""

from __future__ import annotations

from prepkit.tactics.adapters import make_dense_tactic_lookup, make_tactic_lookup
from prepkit.tactics.paths import bundled_db_path, db_to_read, user_db_path
from prepkit.tactics.points import MAX_TOKEN_POINT, TOKEN_POINTS, point_for
from prepkit.tactics.ranges import Range, RangeTable, merge_points
from prepkit.tactics.resolver import TacticResolver, default_resolver, lookup_tactic, runtime_resolver
from prepkit.tactics.suggest import suggest_tune_command
from prepkit.tactics.table import TacticsDBWarning, TacticTable

__all__ = [
    "MAX_TOKEN_POINT",
    "TOKEN_POINTS",
    "Range",
    "RangeTable",
    "TacticResolver",
    "TacticTable",
    "TacticsDBWarning",
    "bundled_db_path",
    "db_to_read",
    "default_resolver",
    "lookup_tactic",
    "make_dense_tactic_lookup",
    "make_tactic_lookup",
    "merge_points",
    "point_for",
    "runtime_resolver",
    "suggest_tune_command",
    "user_db_path",
]

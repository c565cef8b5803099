"""The resolver: one :class:`~prepkit.tactics.table.TacticTable` per problem and device, hits and
misses counted, one warning per missed problem naming the command that would tune it.

Standard library only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from prepkit.tactics.keys import DeviceFacts, Environment, ProblemKey
from prepkit.tactics.points import TOKEN_POINTS
from prepkit.tactics.suggest import suggest_tune_command
from prepkit.tactics.table import TacticsDBWarning, TacticTable, decode_or_none, gemm_tactic_decoder
from prepkit.warn_once import new_owner, warn_once

if TYPE_CHECKING:
    from prepkit.kernels.tactic import GemmTactic


class TacticResolver:
    """Caches one :class:`TacticTable` per (problem, device), counts hits and misses, and warns
    once per (problem, device) when the default must serve."""

    def __init__(
        self,
        *,
        user_db: str | os.PathLike[str] | None = None,
        bundled_db: str | os.PathLike[str] | None | bool = True,
        smoke_check: Callable[[Sequence[str], Sequence[int]], bool] | None = None,
    ) -> None:
        self.user_db = user_db
        self.bundled_db = bundled_db
        self.smoke_check = smoke_check
        self._tables: dict[tuple[ProblemKey, Environment], TacticTable] = {}
        self._warn_owner = new_owner()  # each resolver warns about its own misses
        self._lock = threading.Lock()

    def table(self, problem: ProblemKey, device: Environment | DeviceFacts) -> TacticTable:
        device = Environment.of(device)
        key = (problem, device)
        with self._lock:
            table = self._tables.get(key)
            if table is None:
                table = TacticTable.load(
                    problem, device, user_db=self.user_db, bundled_db=self.bundled_db,
                    smoke_check=self.smoke_check,
                )  # fmt: skip
                self._tables[key] = table
        return table

    def lookup(
        self, problem: ProblemKey, num_tokens: int, device: Environment | DeviceFacts, *, warn: bool = True
    ) -> str | None:
        """Tactic JSON for the call, or ``None`` (the caller's default serves it; with ``warn``,
        warned once by :meth:`warn_miss`)."""
        device = Environment.of(device)
        table = self.table(problem, device)
        tj = table.tactic_for(num_tokens)
        if tj is None and warn:
            self.warn_miss(problem, num_tokens, device)
        return tj

    def warn_miss(self, problem: ProblemKey, num_tokens: int, device: Environment | DeviceFacts) -> None:
        """Say once per problem, device and kind of miss that the default serves ``num_tokens``,
        naming the command that would tune it."""
        device = Environment.of(device)
        table = self.table(problem, device)
        outside = bool(table.ranges)  # a table exists but does not reach this M
        key = (self._warn_owner, problem.problem_hash(), device.arch + device.name, "outside" if outside else "none")
        cmd = suggest_tune_command(table.problem, device.arch)
        where = device.label or "this GPU"
        if outside:
            msg = (
                f"no tuned tactic for {num_tokens} tokens ({table.problem.describe()}): the table from "
                f"{table.db_path} covers 1-{table.max_tuned}; using the built-in default. "
                f"To tune larger batches run: {cmd} --tokens {','.join(map(str, TOKEN_POINTS))}"
            )
        else:
            msg = (
                f"no tuned tactics for {table.problem.describe()} on {where} ({device.arch}, Triton "
                f"{device.triton_version or '?'}); using the built-in default, which may be slower. "
                f"To tune this GPU run: {cmd}"
            )
            if table.notes:
                msg += " (" + "; ".join(table.notes[:3]) + ")"
        warn_once(key, msg, TacticsDBWarning, stacklevel=3)

    def stats(self) -> dict[str, Any]:
        """Hits and misses over every table, and where each table came from (source/tier)."""
        tables = list(self._tables.items())
        return {
            "hits": sum(t.hits for _, t in tables),
            "misses": sum(t.misses for _, t in tables),
            "tables": {problem.describe(): f"{t.source}/{t.tier}" for (problem, _dev), t in tables},
        }

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self._warn_owner = new_owner()  # and warn again


_default_resolver: TacticResolver | None = None


def default_resolver() -> TacticResolver:
    global _default_resolver
    if _default_resolver is None:
        _default_resolver = TacticResolver()
    return _default_resolver


def lookup_tactic(
    problem: ProblemKey,
    num_tokens: int,
    device: Environment | DeviceFacts,
    *,
    resolver: TacticResolver | None = None,
) -> GemmTactic | None:
    """The :class:`~prepkit.kernels.tactic.GemmTactic` for ``num_tokens``, or ``None`` on a miss
    (the caller then uses its built-in default; a warning was issued once)."""
    res = resolver or default_resolver()
    return decode_or_none(res.lookup(problem, num_tokens, device))


_runtime_resolver: TacticResolver | None = None


def runtime_resolver() -> TacticResolver:
    """The resolver behind the runtime's lookups: like :func:`default_resolver`, and rows tuned
    with another Triton minor version serve too when every tactic still decodes (the kernel
    version, which names the kernel source, must match exactly in any case). The runtime falls
    back to the default for a variant that no longer compiles (``prepkit.runtime.moe``)."""
    global _runtime_resolver
    if _runtime_resolver is None:
        _runtime_resolver = TacticResolver(smoke_check=_all_decode)
    return _runtime_resolver


def _all_decode(tactics: Sequence[str], points: Sequence[int]) -> bool:
    decode = gemm_tactic_decoder()
    try:
        for tj in tactics:
            decode(tj)
    except (ValueError, TypeError, KeyError):
        return False
    return True

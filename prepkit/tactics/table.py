"""One problem's winner ranges on one device, read from the tactics DBs in the lookup's order
(:mod:`prepkit.tactics.lookup` tells the order), expanded for O(1) lookup by token count.

Standard library only.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from prepkit.errors import TacticsError
from prepkit.tactics.keys import DeviceFacts, Environment, ProblemKey, triton_minor
from prepkit.tactics.paths import bundled_db_path, user_db_path
from prepkit.tactics.ranges import Range, RangeTable
from prepkit.tactics.schema import MIN_READABLE_SCHEMA, open_readonly

if TYPE_CHECKING:
    from prepkit.kernels.tactic import GemmTactic

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class TacticTable:
    """The ranges that serve one problem on one device, expanded for O(1) lookup."""

    problem: ProblemKey
    ranges: tuple[Range[str], ...] = ()
    source: str = "default"  # 'user' | 'bundled' | 'default'
    tier: str = "default"  # 'exact' | 'triton_minor' | 'default'
    db_path: str | None = None
    env_hash: str | None = None
    notes: tuple[str, ...] = ()
    hits: int = 0
    misses: int = 0
    _table: RangeTable[str] = field(init=False, repr=False)
    _decoded: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._table = RangeTable(self.ranges)

    @property
    def max_tuned(self) -> int:
        return self._table.max_tuned

    def tactic_for(self, num_tokens: int) -> str | None:
        """Tactic JSON for ``num_tokens``, or ``None`` when the default must serve it."""
        tj = self._table.get(num_tokens)
        if tj is None:
            self.misses += 1
        else:
            self.hits += 1
        return tj

    def get(self, num_tokens: int, default: Callable[[int], T], decode: Callable[[str], T] | None = None) -> T:
        """The decoded tactic for ``num_tokens``; ``default(num_tokens)`` on a miss.

        ``decode`` defaults to ``GemmTactic.from_json``; a row the decoder rejects (fields this
        kernel does not know) is served by the default.
        """
        tj = self.tactic_for(num_tokens)
        if tj is None:
            return default(num_tokens)
        if tj not in self._decoded:
            dec = decode or gemm_tactic_decoder()
            try:
                self._decoded[tj] = dec(tj)
            except (ValueError, TypeError, KeyError) as err:
                log.warning("tactic %s from %s cannot be decoded (%s); using the default", tj, self.db_path, err)
                self._decoded[tj] = None
        value = self._decoded[tj]
        return default(num_tokens) if value is None else value

    def tactics(self) -> list[str]:
        """Distinct tactic JSONs of the table (for pre-compiling them at load)."""
        return sorted({r.value for r in self.ranges})

    @classmethod
    def load(
        cls,
        problem: ProblemKey,
        device: Environment | DeviceFacts,
        *,
        user_db: str | os.PathLike[str] | None = None,
        bundled_db: str | os.PathLike[str] | None | bool = True,
        smoke_check: Callable[[Sequence[str], Sequence[int]], bool] | None = None,
    ) -> TacticTable:
        """Pick the table for ``problem`` on ``device`` by the order in the module docstring.

        ``user_db=None`` means :func:`user_db_path`; ``bundled_db=True`` means
        :func:`bundled_db_path`, ``False``/``None`` skips it. A DB that is missing is skipped
        silently; one that is corrupt, foreign or newer is skipped with a warning.
        """
        device = Environment.of(device)
        dbs: list[tuple[str, Path]] = []
        upath = Path(user_db) if user_db is not None else user_db_path()
        dbs.append(("user", upath))
        if bundled_db is True:
            bpath = bundled_db_path()
        elif bundled_db:
            bpath = Path(bundled_db)
        else:
            bpath = None
        if bpath is not None and bpath != upath:
            dbs.append(("bundled", bpath))

        notes: list[str] = []
        other_minor: list[tuple[str, Path, _EnvRows]] = []
        for source, path in dbs:
            if not path.is_file():
                continue
            try:
                found = _read_rows(path, problem, device)
            except TacticsError as err:
                warnings.warn(f"ignoring tactics DB: {err}", TacticsDBWarning, stacklevel=2)
                continue
            exact = [e for e in found if e.triton_minor == device.triton_minor]
            if exact:
                return cls._from_env(problem, exact[0], source, "exact", path)
            other_minor.extend((source, path, e) for e in found)
            notes.extend(
                f"{path}: rows for Triton {e.triton_version} (this device runs {device.triton_version})" for e in found
            )
        for source, path, env in other_minor:
            if smoke_check is None:
                continue
            table = cls._from_env(problem, env, source, "triton_minor", path)
            if table.ranges and smoke_check(table.tactics(), sorted({1, table.max_tuned})):
                return table
            notes.append(f"{path}: Triton {env.triton_version} rows failed the smoke check")
        return cls(problem=problem, notes=tuple(notes))

    @classmethod
    def _from_env(cls, problem: ProblemKey, env: _EnvRows, source: str, tier: str, path: Path) -> TacticTable:
        return cls(
            problem=problem, ranges=tuple(env.ranges), source=source, tier=tier,
            db_path=str(path), env_hash=env.env_hash, notes=tuple(env.notes),
        )  # fmt: skip


class TacticsDBWarning(UserWarning):
    """A tactics DB was skipped, or no tuned tactic serves a problem."""


@dataclass
class _EnvRows:
    env_hash: str
    gpu_name: str
    triton_version: str
    created_at: str
    ranges: list[Range[str]]
    notes: list[str]

    @property
    def triton_minor(self) -> str:
        return triton_minor(self.triton_version)


def _read_rows(path: Path, problem: ProblemKey, device: Environment) -> list[_EnvRows]:
    """Winner ranges per environment of the same compute capability, best environment first."""
    conn, version = open_readonly(path)
    try:
        if version < MIN_READABLE_SCHEMA:
            raise TacticsError(f"{path}: holds no tactics tables", hint="run `prepkit tune --db` on it first")
        rows = conn.execute(
            """
            SELECT e.env_hash, e.gpu_name, e.triton_version, e.created_at,
                   w.m_lo, w.m_hi, w.extends_up, t.params_json, t.tactic_hash
            FROM winner w
            JOIN env e ON e.env_hash = w.env_hash
            JOIN tactic t ON t.tactic_hash = w.tactic_hash
            WHERE w.problem_hash = ? AND e.cc_major = ? AND e.cc_minor = ?
            ORDER BY w.m_lo
            """,
            (problem.problem_hash(), device.cc_major, device.cc_minor),
        ).fetchall()
        blocked = {
            (r[0], r[1])
            for r in conn.execute(
                "SELECT triton_minor, tactic_hash FROM blocklist WHERE cc_major = ? AND cc_minor = ? "
                "AND kernel_hash = ?",
                (device.cc_major, device.cc_minor, problem.kernel_hash()),
            )
        }
    except sqlite3.DatabaseError as err:
        raise TacticsError(f"{path}: cannot read winners ({err})") from err
    finally:
        conn.close()
    envs: dict[str, _EnvRows] = {}
    for env_hash, gpu, tv, created, m_lo, m_hi, up, params, th in rows:
        env = envs.setdefault(env_hash, _EnvRows(env_hash, gpu, tv, created, [], []))
        if (device.triton_minor, th) in blocked:  # it failed with the Triton that would run it
            env.notes.append(f"{params} (M {m_lo}-{m_hi}) is blocklisted for Triton {device.triton_minor}")
            continue
        env.ranges.append(Range(int(m_lo), int(m_hi), params, bool(up)))
    # Same GPU model first, then the newest measurement.
    ordered = sorted(envs.values(), key=lambda e: e.created_at, reverse=True)
    ordered.sort(key=lambda e: e.gpu_name != device.name)
    return [e for e in ordered if e.ranges]


def gemm_tactic_decoder() -> Callable[[str], GemmTactic]:
    from prepkit.kernels.tactic import GemmTactic

    return GemmTactic.from_json


def decode_or_none(tj: str | None) -> GemmTactic | None:
    if tj is None:
        return None
    try:
        return gemm_tactic_decoder()(tj)
    except (ValueError, TypeError) as err:
        log.warning("stored tactic %s cannot be decoded (%s); using the default", tj, err)
        return None

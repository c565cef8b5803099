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

Token ranges use ceil semantics: the tactic measured at token point M serves ``(previous point,
M]``; above the last tuned point only a range marked ``extends_up`` serves. :func:`merge_points`
and :class:`RangeTable` are the one implementation of that rule; the tuner, the store and the
runtime all use them.

Standard library only, so ``import prepkit.runtime`` stays cheap.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import warnings
from bisect import bisect_left
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from prepkit.constants import TACTICS_DB_NAME
from prepkit.data import tactics_db
from prepkit.errors import TacticsError
from prepkit.tactics.keys import (
    DENSE_ROLE,
    DENSE_W_DTYPES,
    KERNEL_NAME,
    DeviceFacts,
    Environment,
    ProblemKey,
    dense_problem,
    layer_problems,
    triton_minor,
)
from prepkit.tactics.schema import MIN_READABLE_SCHEMA, open_readonly
from prepkit.warn_once import new_owner, warn_once

if TYPE_CHECKING:
    from prepkit.kernels.activations import ActivationPolicy
    from prepkit.kernels.device import DeviceInfo
    from prepkit.kernels.tactic import GemmTactic
    from prepkit.layer import MoeProblem, RankLayer
    from prepkit.runtime.dense import DenseTacticLookup
    from prepkit.runtime.moe import TacticLookup

log = logging.getLogger(__name__)

T = TypeVar("T")
V = TypeVar("V", bound=Hashable)


def _series() -> tuple[int, ...]:
    # Every integer 1-8 (decode and speculative widths), then 1.5x and 2x steps up to 8192: the
    # latency curve bends where tiles fill, and these steps land on both sides of each bend.
    pts = list(range(1, 9))
    p = 8
    while p < 8192:
        pts.extend((p + p // 2, 2 * p))
        p *= 2
    return tuple(pts)


TOKEN_POINTS: tuple[int, ...] = _series()
MAX_TOKEN_POINT = TOKEN_POINTS[-1]


# ------------------------------------------------------------------------------------ ranges


@dataclass(frozen=True)
class Range(Generic[V]):
    """``value`` serves token counts ``m_lo..m_hi`` (and above, when ``extends_up``)."""

    m_lo: int
    m_hi: int
    value: V
    extends_up: bool = False


def merge_points(points: Sequence[int], winners: Sequence[V | None]) -> list[tuple[int, int, list[int]]]:
    """Group per-point winners into ranges with ceil semantics.

    ``points`` ascending positive; ``winners[i]`` is the value chosen at ``points[i]`` (``None``:
    no winner, the range is left to the default). Adjacent points with the same value share one
    range. Returns ``(m_lo, m_hi, indices of the points in the range)`` per range.

    Raises:
        ValueError: lengths differ, or the points are not ascending positive integers.
    """
    pts = list(points)
    if len(pts) != len(winners):
        raise ValueError("points and winners differ in length")
    if any(b <= a for a, b in zip(pts, pts[1:], strict=False)) or (pts and pts[0] < 1):
        raise ValueError(f"token points must be ascending positive integers, got {pts}")
    out: list[tuple[int, int, list[int]]] = []
    group: list[int] = []
    lo = 1
    for i, w in enumerate(winners):
        prev = pts[i - 1] if i else 0
        if w is None:
            if group:
                out.append((lo, pts[group[-1]], group))
            group = []
        elif group and winners[group[-1]] == w:
            group.append(i)
        else:
            if group:
                out.append((lo, pts[group[-1]], group))
            group, lo = [i], prev + 1
    if group:
        out.append((lo, pts[group[-1]], group))
    return out


class RangeTable(Generic[V]):
    """Ranges expanded for O(1) lookup by token count."""

    def __init__(self, ranges: Sequence[Range[V]]) -> None:
        top = max((r.m_hi for r in ranges), default=0)
        dense: list[V | None] = [None] * (top + 1)
        for r in ranges:
            for m in range(r.m_lo, r.m_hi + 1):
                dense[m] = r.value
        self._dense = dense
        last = max(ranges, key=lambda r: r.m_hi, default=None)
        self._up = last.value if last is not None and last.extends_up else None

    @property
    def max_tuned(self) -> int:
        return len(self._dense) - 1

    def get(self, num_tokens: int) -> V | None:
        """The value serving ``num_tokens``, or ``None`` (the default serves it)."""
        if 0 < num_tokens < len(self._dense):
            return self._dense[num_tokens]
        if num_tokens >= len(self._dense):
            return self._up
        return None


def point_for(num_tokens: int, points: Sequence[int] = TOKEN_POINTS) -> int | None:
    """The tuned point that serves ``num_tokens`` under ceil semantics (None above the last)."""
    i = bisect_left(points, num_tokens)
    return points[i] if i < len(points) else None


# ---------------------------------------------------------------------------------- DB paths


def user_db_path() -> Path:
    """``$PREPKIT_TACTICS_DB``, else ``$XDG_CACHE_HOME/prepkit/tactics.db`` (``~/.cache``)."""
    env = os.environ.get("PREPKIT_TACTICS_DB")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "prepkit" / TACTICS_DB_NAME


def bundled_db_path() -> Path | None:
    """The DB shipped with the package (:func:`prepkit.data.tactics_db`), in a wheel install and an
    editable one alike; ``None`` if it is missing (a broken install: the lookup then skips it)."""
    path = tactics_db()
    return path if path.is_file() else None


def db_to_read(explicit: Path | None = None) -> Path:
    """The DB a reading command shows: ``explicit``, else the user DB if it exists, else the
    bundled one (the first two tiers of the lookup order).

    Raises:
        TacticsError: none of them exists.
    """
    if explicit is not None:
        return explicit
    user = user_db_path()
    if user.is_file():
        return user
    bundled = bundled_db_path()
    if bundled is None:
        raise TacticsError("no tactics DB found", hint="run `prepkit tune`, or pass --db")
    return bundled


def suggest_tune_command(problem: ProblemKey, arch: str) -> str:
    """The command line that would fill the DB for ``problem`` on this device."""
    acts = "" if problem.act_dtype == "bf16" else f" --activations {problem.act_dtype}"
    if problem.role == DENSE_ROLE:
        fmt = {w: f for f, w in DENSE_W_DTYPES.items()}.get(problem.w_dtype, "all")
        # gpt-oss-120b and -20b share their dense shapes: fused qkv, o, lm_head.
        gpt_oss = (problem.n, problem.k) in {(5120, 2880), (2880, 4096), (201088, 2880)}
        src = "--model gpt-oss-120b" if gpt_oss else "--shards DIR"
        return f"prepkit tune --arch {arch} {src} --dense {fmt} --no-moe{acts}"
    hidden, gemm1_i = problem.layer_dims
    models = {(128, 2880): "gpt-oss-120b", (32, 2880): "gpt-oss-20b"}
    model = models.get((problem.num_experts * problem.ep_size, hidden))
    src = f"--model {model}" if model and gemm1_i * problem.tp_size == 2880 else "--shards DIR"
    return f"prepkit tune --arch {arch} {src} --tp {problem.tp_size}{acts}"


# ------------------------------------------------------------------------------------ tables


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
            dec = decode or _gemm_tactic_decoder()
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


def _gemm_tactic_decoder() -> Callable[[str], GemmTactic]:
    from prepkit.kernels.tactic import GemmTactic

    return GemmTactic.from_json


# ---------------------------------------------------------------------------------- resolver


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
        where = device.name or "this GPU"
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
    return _decode_or_none(res.lookup(problem, num_tokens, device))


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
    decode = _gemm_tactic_decoder()
    try:
        for tj in tactics:
            decode(tj)
    except (ValueError, TypeError, KeyError):
        return False
    return True


def make_tactic_lookup(
    *,
    resolver: TacticResolver | None = None,
    kernel: str = KERNEL_NAME,
    kernel_version: str | int | None = None,
    weight_layout: str | None = None,
    activations: ActivationPolicy = "bf16",
) -> TacticLookup:
    """A ``prepkit.runtime.moe.TacticLookup`` backed by the tactic DBs.

    Called with a ``prepkit.layer.MoeProblem`` (a rank's layer record and a token count) and the
    kernels' ``DeviceInfo``, it returns ``(gemm1, gemm2)`` tactics. A GEMM without a tuned row
    gets the built-in default for its slot; when neither GEMM has one it returns ``None`` and the
    layer's own default applies. Either way one warning names the tune command, once per missed
    problem (and per layer, when a layer calls it). ``kernel_version=None`` reads
    ``prepkit.kernels.mx.KERNEL_VERSION`` on first use; ``weight_layout=None`` is the
    bundled kernel's layout. ``activations`` is the activation precision policy the layer runs
    with: rows tuned for another policy never serve it. ``resolver=None`` is
    :func:`runtime_resolver`: a table tuned with another Triton minor version serves, with one
    warning naming both versions.
    """
    res = resolver or runtime_resolver()
    owner = new_owner()

    def note_other_triton(key: ProblemKey, device: DeviceInfo) -> None:
        table = res.table(key, device)
        if table.tier != "triton_minor":
            return
        env = Environment.of(device)
        warn_once(
            (owner, "other triton", key.role),
            f"tactics for {key.describe()} were tuned with another Triton than this one "
            f"({env.triton_version}); they run as they are (same kernel version). `prepkit tune` "
            "re-measures them for this Triton",
            TacticsDBWarning,
            stacklevel=4,
        )

    version: list[str] = [] if kernel_version is None else [str(kernel_version)]
    layout = weight_layout or _kernel_layout()
    problems: dict[RankLayer, dict[str, ProblemKey]] = {}

    def lookup(problem: MoeProblem, device: DeviceInfo) -> tuple[GemmTactic, GemmTactic] | None:
        if not version:
            from prepkit.kernels.mx import KERNEL_VERSION

            version.append(str(KERNEL_VERSION))
        keys = problems.get(problem.layer)
        if keys is None:
            keys = layer_problems(
                problem.layer, kernel=kernel, kernel_version=version[0], weight_layout=layout, act_dtype=activations
            )
            problems[problem.layer] = keys
        found = {role: res.lookup(keys[role], problem.num_tokens, device, warn=False) for role in ("gemm1", "gemm2")}
        missed = [role for role, tj in found.items() if tj is None]
        if missed:
            # One warning for the call, about the first GEMM that missed: one tune run fills both.
            res.warn_miss(keys[missed[0]], problem.num_tokens, device)
        decoded = {role: _decode_or_none(tj) for role, tj in found.items()}
        g1, g2 = decoded["gemm1"], decoded["gemm2"]
        if g1 is None and g2 is None:
            return None
        for role, tactic in decoded.items():
            if tactic is not None:
                note_other_triton(keys[role], device)
        if g1 is None or g2 is None:
            from prepkit.kernels.variants import default_tactics

            d1, d2 = default_tactics(problem, device, activations)
            g1, g2 = g1 or d1, g2 or d2
        return g1, g2

    return lookup


def make_dense_tactic_lookup(
    *,
    resolver: TacticResolver | None = None,
    kernel: str = KERNEL_NAME,
    kernel_version: str | int | None = None,
    weight_layout: str | None = None,
) -> DenseTacticLookup:
    """A ``prepkit.runtime.dense.DenseTacticLookup`` backed by the tactic DBs: called with the
    token count, the weight's ``n``/``k``/format, the activation policy and the kernels'
    ``DeviceInfo``, it returns the tuned tactic of that dense problem (its own problem key,
    :func:`~prepkit.tactics.keys.dense_problem`), else the built-in
    :func:`~prepkit.kernels.variants.dense_default` after one warning naming the tune command.
    ``kernel_version=None`` reads ``prepkit.kernels.mx.KERNEL_VERSION`` on first use;
    ``weight_layout=None`` is the dense MX layout."""
    res = resolver or runtime_resolver()
    version: list[str] = [] if kernel_version is None else [str(kernel_version)]
    layout = weight_layout or _dense_layout()
    keys: dict[tuple[int, int, str, str], ProblemKey] = {}

    def lookup(
        num_tokens: int, n: int, k: int, fmt: str, activations: ActivationPolicy, device: DeviceInfo
    ) -> GemmTactic:
        if not version:
            from prepkit.kernels.mx import KERNEL_VERSION

            version.append(str(KERNEL_VERSION))
        key = keys.get((n, k, fmt, activations))
        if key is None:
            key = dense_problem(
                kernel=kernel, kernel_version=version[0], weight_layout=layout, n=n, k=k, fmt=fmt,
                act_dtype=activations,
            )  # fmt: skip
            keys[(n, k, fmt, activations)] = key
        tactic = _decode_or_none(res.lookup(key, num_tokens, device))
        if tactic is not None:
            return tactic
        from prepkit.kernels.variants import dense_default

        return dense_default(num_tokens, n, k, fmt, device, activations)

    return lookup


def _dense_layout() -> str:
    from prepkit.constants import DENSE_MX_LAYOUT_ID

    return DENSE_MX_LAYOUT_ID


def _decode_or_none(tj: str | None) -> GemmTactic | None:
    if tj is None:
        return None
    try:
        return _gemm_tactic_decoder()(tj)
    except (ValueError, TypeError) as err:
        log.warning("stored tactic %s cannot be decoded (%s); using the default", tj, err)
        return None


def _kernel_layout() -> str:
    from prepkit.constants import TRITON_MOE_LAYOUT_ID

    return TRITON_MOE_LAYOUT_ID

"""Which kernel variant (tactic) to launch for a token count: the runtime side of ``tactics.db``.

Contract for the MoE runtime (``prepkit.runtime.moe``)
-----------------------------------------------------
Build one :class:`ProblemKey` per GEMM of a layer (``gpt_oss_problems`` does it from the model
dims), then either

* at load time: ``table = TacticTable.load(problem, device)``, and per call
  ``tactic = table.tactic_for(num_tokens)`` (O(1); ``None`` means "use your built-in default"),
  or ``table.get(num_tokens, default_fn)`` which returns the decoded :class:`GemmTactic`, or
* ad hoc: ``lookup_tactic(problem, num_tokens, device)`` which caches one table per problem
  and device in a module-level :class:`TacticResolver`.

``device`` is an :class:`Environment` or the kernels' ``prepkit.kernels.device.DeviceInfo``
(software versions are then read from the installed packages' metadata).

Where a table comes from, in order (first that has winners for the problem wins):

1. the user DB (``$PREPKIT_TACTICS_DB``, else ``$XDG_CACHE_HOME/prepkit/tactics.db``), rows
   measured with the same Triton minor version;
2. the bundled ``tactics.db`` (inside the package, else the repository top), same rule;
3. either DB with rows from another Triton minor version, only if the caller passed a
   ``smoke_check`` and it accepts every tactic of the table (compiles, runs, matches the default);
4. the built-in default (``None`` here): counted as a miss, with one warning per problem and
   device that names the ``prepkit tune`` command to run.

A row is never used when its compute capability differs from the device's, or its kernel name,
role, kernel version or weight layout differs from the problem's (those are part of the problem
hash, so such rows simply do not match). Tactics in the blocklist for this compute capability and
Triton minor are dropped. Ranges use ceil semantics: the tactic measured at M serves
``(previous point, M]``; above the last tuned point only a range marked ``extends_up`` serves.

This module imports only the standard library (``torch``/``triton`` lazily in
:meth:`Environment.current`), so ``import prepkit.runtime`` stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import warnings
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from prepkit.errors import TacticsError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Identifies a prepkit tactics DB (PRAGMA application_id): ASCII "PKTD".
APPLICATION_ID = 0x504B5444
# PRAGMA user_version written by the newest migration this code knows; readers refuse newer.
SCHEMA_VERSION = 1
# Oldest schema whose winner/env/tactic/blocklist tables this reader understands.
MIN_READABLE_SCHEMA = 1

ROLES = ("gemm1", "gemm2")
KERNEL_NAME = "moe_mxfp4"  # prepkit.kernels.moe_mxfp4
WEIGHT_LAYOUT = "triton_moe_v3"


def _series() -> tuple[int, ...]:
    # Every integer 1-8 (decode and speculative widths), then 1.5x/2x steps up to 8192 (tactics.md §7.4).
    pts = list(range(1, 9))
    p = 8
    while p < 8192:
        pts.extend((p + p // 2, 2 * p))
        p *= 2
    return tuple(pts)


TOKEN_POINTS: tuple[int, ...] = _series()
MAX_TOKEN_POINT = TOKEN_POINTS[-1]


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no spaces: the form that is hashed and stored."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def digest(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:32]


def tactic_hash(params_json: str) -> str:
    """Hash of a tactic's JSON, independent of key order and spacing."""
    return digest(json.loads(params_json))


def arch_name(cc_major: int, cc_minor: int) -> str:
    """``(9, 0)`` -> ``'sm90'``, ``(12, 1)`` -> ``'sm121'``."""
    return f"sm{cc_major}{cc_minor}"


def triton_minor(version: str) -> str:
    """``'3.6.0'`` -> ``'3.6'``; an empty or odd string stays as it is."""
    parts = version.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else version


@dataclass(frozen=True)
class ProblemKey:
    """Everything that changes the math or the best variant of one GEMM, except the token count.

    ``n``/``k`` are per-rank sizes as the checkpoint has them (before the layout pads them); the
    layout id covers the padding. ``tp_size``/``ep_size`` are stored for people, not matched. The
    kernel fields are part of the key: a new kernel version or layout never matches rows measured
    for an old one.
    """

    kernel: str
    kernel_version: str
    weight_layout: str
    role: str  # 'gemm1' (gate/up + SwiGLU) or 'gemm2' (down + routed sum)
    num_experts: int  # local experts on this rank
    top_k: int
    n: int
    k: int
    act_dtype: str = "bf16"
    w_dtype: str = "mxfp4_e2m1"
    out_dtype: str = "bf16"
    activation: str = "none"
    tp_size: int = 1
    ep_size: int = 1

    def kernel_fields(self) -> dict[str, str]:
        return {
            "name": self.kernel,
            "role": self.role,
            "kernel_version": str(self.kernel_version),
            "weight_layout": self.weight_layout,
        }

    def kernel_hash(self) -> str:
        return digest(self.kernel_fields())

    def shape_fields(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("kernel", "kernel_version", "weight_layout", "role"):
            d.pop(name)
        return d

    def problem_hash(self) -> str:
        # tp/ep are recorded but not hashed: the kernel sees only per-rank sizes (n, k, local
        # experts), and the runtime knows nothing else about the rank.
        fields = {k: v for k, v in self.shape_fields().items() if k not in ("tp_size", "ep_size")}
        return digest({"kernel": self.kernel_hash(), **fields})

    def describe(self) -> str:
        return (
            f"{self.role} E={self.num_experts} top_k={self.top_k} N={self.n} K={self.k} "
            f"tp={self.tp_size} ({self.kernel} v{self.kernel_version}, layout {self.weight_layout})"
        )


def gpt_oss_problems(
    *,
    kernel: str,
    kernel_version: str,
    weight_layout: str,
    num_experts: int = 128,
    hidden: int = 2880,
    intermediate: int = 2880,
    top_k: int = 4,
    tp_size: int = 1,
    ep_size: int = 1,
    act_dtype: str = "bf16",
) -> dict[str, ProblemKey]:
    """The two GEMM problems of one gpt-oss MoE layer on one rank, keyed by role."""
    local_i = intermediate // tp_size
    local_e = num_experts // ep_size
    common = dict(
        kernel=kernel, kernel_version=str(kernel_version), weight_layout=weight_layout,
        num_experts=local_e, top_k=top_k, act_dtype=act_dtype, tp_size=tp_size, ep_size=ep_size,
    )  # fmt: skip
    return {
        "gemm1": ProblemKey(role="gemm1", n=2 * local_i, k=hidden, activation="swiglu_oai", **common),
        "gemm2": ProblemKey(role="gemm2", n=hidden, k=local_i, activation="routed_sum", **common),
    }


def suggest_tune_command(problem: ProblemKey, arch: str) -> str:
    """The command line that would fill the DB for ``problem`` on this device."""
    gemm1_i = problem.n // 2 if problem.role == "gemm1" else problem.k
    hidden = problem.k if problem.role == "gemm1" else problem.n
    models = {(128, 2880): "gpt-oss-120b", (32, 2880): "gpt-oss-20b"}
    model = models.get((problem.num_experts * problem.ep_size, hidden))
    src = f"--model {model}" if model and gemm1_i * problem.tp_size == 2880 else "--shards DIR"
    return f"prepkit tune --arch {arch} {src} --tp {problem.tp_size}"


@dataclass(frozen=True)
class Environment:
    """The GPU and software stack a row was measured on, or that a lookup runs on.

    Passed in (never probed inside a heuristic). :meth:`of` also takes the kernels'
    ``prepkit.kernels.device.DeviceInfo`` (filling software versions from the installed
    packages), and :meth:`current` reads the current CUDA device through torch.
    """

    cc_major: int
    cc_minor: int
    name: str = ""
    sm_count: int = 0
    l2_bytes: int = 0
    smem_per_block_optin: int = 0
    mem_bytes: int = 0
    triton_version: str = ""
    torch_version: str = ""
    cuda_version: str = ""
    driver_version: str = ""

    @property
    def arch(self) -> str:
        return arch_name(self.cc_major, self.cc_minor)

    @property
    def triton_minor(self) -> str:
        return triton_minor(self.triton_version)

    @classmethod
    def of(cls, device: Any) -> Environment:
        """Accept an :class:`Environment` or anything with ``capability``/``name``/``sm_count``
        (the kernels' ``DeviceInfo``); versions come from the installed distributions."""
        if isinstance(device, Environment):
            return device
        try:
            cc_major, cc_minor = (int(x) for x in device.capability)
        except (AttributeError, TypeError, ValueError) as err:
            raise TypeError(f"cannot describe the device from {device!r}") from err
        return cls(
            cc_major=cc_major,
            cc_minor=cc_minor,
            name=str(getattr(device, "name", "")),
            sm_count=int(getattr(device, "sm_count", 0)),
            l2_bytes=int(getattr(device, "l2_bytes", 0)),
            smem_per_block_optin=int(getattr(device, "max_shared_mem", 0)),
            triton_version=str(getattr(device, "triton_version", "") or _dist_version("triton")),
            torch_version=str(getattr(device, "torch_version", "") or _dist_version("torch")),
        )

    @classmethod
    def current(cls, device: int | None = None) -> Environment:
        """Describe the current CUDA device.

        Raises:
            DeviceError: torch sees no CUDA device.
        """
        import torch

        from prepkit.errors import DeviceError

        if not torch.cuda.is_available():
            raise DeviceError(
                "no CUDA device is visible to torch",
                hint="run on a machine with an NVIDIA GPU, or check CUDA_VISIBLE_DEVICES and the driver",
            )
        idx = torch.cuda.current_device() if device is None else device
        props = torch.cuda.get_device_properties(idx)
        try:
            import triton

            triton_version = str(triton.__version__)
        except ImportError:
            triton_version = ""
        return cls(
            cc_major=int(props.major),
            cc_minor=int(props.minor),
            name=str(props.name),
            sm_count=int(props.multi_processor_count),
            l2_bytes=int(getattr(props, "L2_cache_size", 0)),
            smem_per_block_optin=int(getattr(props, "shared_memory_per_block_optin", 0)),
            mem_bytes=int(props.total_memory),
            triton_version=triton_version,
            torch_version=str(torch.__version__),
            cuda_version=str(torch.version.cuda or ""),
            driver_version=_driver_version(),
        )


def _dist_version(name: str) -> str:
    # Package metadata, not an import: reading triton's version must not load triton.
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def _driver_version() -> str:
    try:
        import torch

        v = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
        if v:
            return f"{v // 1000}.{(v % 1000) // 10}"
    except Exception:  # the driver version is informational only
        pass
    return ""


# --------------------------------------------------------------------------------------- DB paths


def user_db_path() -> Path:
    """``$PREPKIT_TACTICS_DB``, else ``$XDG_CACHE_HOME/prepkit/tactics.db`` (``~/.cache``)."""
    env = os.environ.get("PREPKIT_TACTICS_DB")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "prepkit" / "tactics.db"


def bundled_db_path() -> Path | None:
    """The shipped DB: inside the package when installed from a wheel, else the repository top."""
    pkg = Path(__file__).resolve().parent.parent
    for candidate in (pkg / "tactics.db", pkg.parent / "tactics.db"):
        if candidate.is_file():
            return candidate
    return None


# ------------------------------------------------------------------------------------ reading


def check_header(conn: sqlite3.Connection, path: str) -> int:
    """Validate application id and schema version; return the schema version.

    Raises:
        TacticsError: not a SQLite file, a foreign SQLite DB, or a newer schema.
    """
    try:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        n_tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    except sqlite3.OperationalError as err:
        if "locked" in str(err) or "busy" in str(err):
            raise  # another process holds the file: the caller may wait and retry
        raise TacticsError(f"{path}: not a readable SQLite database ({err})") from err
    except sqlite3.DatabaseError as err:
        raise TacticsError(
            f"{path}: not a readable SQLite database ({err})",
            hint=f"move it away and re-create it with `prepkit tune`, or pass another --db (file: {path})",
        ) from err
    if app_id != APPLICATION_ID:
        if app_id == 0 and n_tables == 0:
            return 0  # empty file: a DB that was never written
        raise TacticsError(
            f"{path}: a SQLite database but not a prepkit tactics DB "
            f"(application_id {app_id:#x}, expected {APPLICATION_ID:#x})",
            hint="point --db / PREPKIT_TACTICS_DB at a tactics DB; prepkit never writes into foreign DBs",
        )
    if version > SCHEMA_VERSION:
        raise TacticsError(
            f"{path}: schema version {version} is newer than this prepkit understands ({SCHEMA_VERSION})",
            hint="upgrade prepkit (pip install -U prepkit), or use a DB written by this version",
        )
    return int(version)


def open_readonly(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """Open a tactics DB without writing to it (``mode=ro``) and validate its header.

    Raises:
        TacticsError: missing, unreadable, foreign or newer-schema DB.
    """
    p = Path(path)
    if not p.is_file():
        raise TacticsError(f"{p}: no such tactics DB", hint="run `prepkit tune` first, or pass another --db")
    try:
        conn = sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error as err:
        raise TacticsError(f"{p}: cannot open ({err})") from err
    try:
        try:
            version = check_header(conn, str(p))
        except sqlite3.OperationalError as err:
            raise TacticsError(f"{p}: busy, another process holds it ({err})") from err
        if version < MIN_READABLE_SCHEMA:
            raise TacticsError(f"{p}: holds no tactics tables", hint="run `prepkit tune --db` on it first")
    except BaseException:
        conn.close()
        raise
    return conn


@dataclass(frozen=True)
class Range:
    m_lo: int
    m_hi: int
    params_json: str
    extends_up: bool = False


@dataclass
class TacticTable:
    """The ranges that serve one problem on one device, expanded for O(1) lookup."""

    problem: ProblemKey
    ranges: tuple[Range, ...] = ()
    source: str = "default"  # 'user' | 'bundled' | 'default'
    tier: str = "default"  # 'exact' | 'triton_minor' | 'default'
    db_path: str | None = None
    env_hash: str | None = None
    notes: tuple[str, ...] = ()
    hits: int = 0
    misses: int = 0
    _dense: list[str | None] = field(default_factory=list, repr=False)
    _up: str | None = field(default=None, repr=False)
    _decoded: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        top = max((r.m_hi for r in self.ranges), default=0)
        dense: list[str | None] = [None] * (top + 1)
        for r in self.ranges:
            for m in range(r.m_lo, r.m_hi + 1):
                dense[m] = r.params_json
        self._dense = dense
        last = max(self.ranges, key=lambda r: r.m_hi, default=None)
        self._up = last.params_json if last is not None and last.extends_up else None

    @property
    def max_tuned(self) -> int:
        return len(self._dense) - 1

    def tactic_for(self, num_tokens: int) -> str | None:
        """Tactic JSON for ``num_tokens``, or ``None`` when the default must serve it."""
        m = num_tokens
        if 0 < m < len(self._dense):
            tj = self._dense[m]
        elif m >= len(self._dense):
            tj = self._up
        else:
            tj = None
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
        return sorted({r.params_json for r in self.ranges})

    @classmethod
    def load(
        cls,
        problem: ProblemKey,
        device: Environment | Any,
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
    ranges: list[Range]
    notes: list[str]

    @property
    def triton_minor(self) -> str:
        return triton_minor(self.triton_version)


def _read_rows(path: Path, problem: ProblemKey, device: Environment) -> list[_EnvRows]:
    """Winner ranges per environment of the same compute capability, best environment first."""
    conn = open_readonly(path)
    try:
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


def _gemm_tactic_decoder() -> Callable[[str], Any]:
    from prepkit.kernels.tactic import GemmTactic

    return GemmTactic.from_json


# ---------------------------------------------------------------------------------- resolver


@dataclass
class LookupStats:
    hits: int = 0
    misses: int = 0
    tables: dict[str, str] = field(default_factory=dict)  # problem description -> source/tier

    def as_dict(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "tables": dict(self.tables)}


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
        self._warned: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()

    def table(self, problem: ProblemKey, device: Environment | Any) -> TacticTable:
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

    def lookup(self, problem: ProblemKey, num_tokens: int, device: Environment | Any) -> str | None:
        """Tactic JSON for the call, or ``None`` (the caller's default serves it; warned once)."""
        device = Environment.of(device)
        table = self.table(problem, device)
        tj = table.tactic_for(num_tokens)
        if tj is None:
            self._warn_miss(table, num_tokens, device)
        return tj

    def _warn_miss(self, table: TacticTable, num_tokens: int, device: Environment) -> None:
        outside = bool(table.ranges)  # a table exists but does not reach this M
        key = (table.problem.problem_hash(), device.arch + device.name, "outside" if outside else "none")
        if key in self._warned:
            return
        self._warned.add(key)
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
        warnings.warn(msg, TacticsDBWarning, stacklevel=3)

    def stats(self) -> LookupStats:
        s = LookupStats()
        for (problem, _dev), t in self._tables.items():
            s.hits += t.hits
            s.misses += t.misses
            s.tables[problem.describe()] = f"{t.source}/{t.tier}"
        return s

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self._warned.clear()


_default_resolver: TacticResolver | None = None


def default_resolver() -> TacticResolver:
    global _default_resolver
    if _default_resolver is None:
        _default_resolver = TacticResolver()
    return _default_resolver


def lookup_tactic(
    problem: ProblemKey,
    num_tokens: int,
    device: Environment | Any,
    *,
    resolver: TacticResolver | None = None,
) -> Any | None:
    """The :class:`~prepkit.kernels.tactic.GemmTactic` for ``num_tokens``, or ``None`` on a miss
    (the caller then uses its built-in default; a warning was issued once)."""
    res = resolver or default_resolver()
    tj = res.lookup(problem, num_tokens, device)
    if tj is None:
        return None
    try:
        return _gemm_tactic_decoder()(tj)
    except (ValueError, TypeError) as err:
        log.warning("stored tactic %s cannot be decoded (%s); using the default", tj, err)
        return None


def lookup_stats() -> dict[str, Any]:
    """Hits/misses of the module-level resolver (what ``lookup_tactic`` used)."""
    return default_resolver().stats().as_dict()


def expand_ranges(points: Iterable[int], winners: Sequence[str]) -> list[Range]:
    """Merge per-point winners into ``[m_lo, m_hi]`` ranges with ceil semantics.

    ``points`` ascending; ``winners[i]`` is the tactic JSON chosen at ``points[i]``. Adjacent points
    with the same tactic share one range. No range is marked ``extends_up`` here.
    """
    pts = list(points)
    if len(pts) != len(winners):
        raise ValueError("points and winners differ in length")
    if any(b <= a for a, b in zip(pts, pts[1:], strict=False)) or (pts and pts[0] < 1):
        raise ValueError(f"token points must be ascending positive integers, got {pts}")
    out: list[Range] = []
    lo = 1
    for i, (m, tj) in enumerate(zip(pts, winners, strict=True)):
        if i + 1 < len(pts) and winners[i + 1] == tj:
            continue
        out.append(Range(lo, m, tj))
        lo = m + 1
    return out


def point_for(num_tokens: int, points: Sequence[int] = TOKEN_POINTS) -> int | None:
    """The tuned point that serves ``num_tokens`` under ceil semantics (None above the last)."""
    i = bisect_left(points, num_tokens)
    return points[i] if i < len(points) else None


def make_tactic_lookup(
    *,
    resolver: TacticResolver | None = None,
    kernel: str = KERNEL_NAME,
    kernel_version: str | int | None = None,
    weight_layout: str = WEIGHT_LAYOUT,
    tp_size: int = 1,
) -> Callable[[Any, Any], tuple[Any, Any] | None]:
    """A ``prepkit.runtime.moe.TacticLookup`` backed by the tactic DBs.

    Called with a ``MoeProblem`` (tokens, local experts, hidden, valid intermediate, top_k) and
    the kernels' ``DeviceInfo``, it returns ``(gemm1, gemm2)`` tactics. A GEMM without a tuned
    row gets the built-in default for its slot (warned once, naming the tune command); when
    neither GEMM has one it returns ``None`` and the layer's own default applies.
    ``kernel_version=None`` reads ``prepkit.kernels.moe_mxfp4.KERNEL_VERSION`` on first use.
    """
    res = resolver or default_resolver()
    version: list[str] = [] if kernel_version is None else [str(kernel_version)]
    problems: dict[tuple[int, int, int, int], dict[str, ProblemKey]] = {}

    def lookup(problem: Any, device: Any) -> tuple[Any, Any] | None:
        if not version:
            from prepkit.kernels.moe_mxfp4 import KERNEL_VERSION

            version.append(str(KERNEL_VERSION))
        dims = (problem.num_experts, problem.hidden, problem.intermediate, problem.top_k)
        keys = problems.get(dims)
        if keys is None:
            keys = gpt_oss_problems(
                kernel=kernel, kernel_version=version[0], weight_layout=weight_layout,
                num_experts=problem.num_experts, hidden=problem.hidden,
                intermediate=problem.intermediate * tp_size, top_k=problem.top_k, tp_size=tp_size,
            )  # fmt: skip
            problems[dims] = keys
        g1 = lookup_tactic(keys["gemm1"], problem.num_tokens, device, resolver=res)
        g2 = lookup_tactic(keys["gemm2"], problem.num_tokens, device, resolver=res)
        if g1 is None and g2 is None:
            return None
        if g1 is None or g2 is None:
            from prepkit.kernels.variants import default_tactics

            d1, d2 = default_tactics(problem, device)
            g1, g2 = g1 or d1, g2 or d2
        return g1, g2

    return lookup

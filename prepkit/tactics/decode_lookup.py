"""Which variant a decode kernel runs: the tuned winner of its problem on this device, else the
kernel's default (:mod:`prepkit.kernels.decode.variants` defines kernels, problems and variants).

A row serves when its compute capability and Triton minor version are the device's and its kernel
version is the kernel's (:func:`decode_kernel_version`); rows of the same GPU model come first,
then the newest. The DBs are read as the MoE lookup reads them (:mod:`prepkit.tactics.lookup`):
the user DB, then the bundled one, read-only, a missing one skipped silently and a broken one with
a warning. Meant for load time (each call opens the DB); the step keeps what it returns.

Standard library only.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prepkit.errors import DeviceError, TacticsError
from prepkit.tactics.keys import DeviceFacts, Environment, triton_minor
from prepkit.tactics.paths import bundled_db_path, user_db_path
from prepkit.tactics.schema import DECODE_WINNER, open_readonly
from prepkit.tactics.table import TacticsDBWarning

if TYPE_CHECKING:
    from prepkit.kernels.decode.variants import DecodeKernel, DecodeProblem, DecodeVariant

log = logging.getLogger(__name__)

# Decode variants pinned by problem key for one process, served before any DB row: how one
# variant is timed inside the step (``python -m benchmarks.compare_builds ... --head-env``).
PINNED_ENV = "PREPKIT_DECODE_VARIANTS"


def decode_kernel_version(kernel: Any) -> str:
    """The version a decode kernel's rows are stored under: its ``version`` attribute where it has
    one, else prepkit's own (a new release may change any kernel, so its rows are measured again)."""
    from prepkit import __version__

    return str(getattr(kernel, "version", None) or __version__)


def decode_variant(
    kernel: DecodeKernel,
    problem: DecodeProblem,
    db: str | os.PathLike[str] | None = None,
    *,
    device: Environment | DeviceFacts | None = None,
) -> DecodeVariant:
    """The tuned variant of ``kernel`` for ``problem`` on ``device``, else ``kernel.default(problem)``.

    ``db``: the one DB to read; ``None`` reads the user DB, then the bundled one. ``device``:
    the device the kernel runs on (an :class:`Environment` or the kernels' ``DeviceInfo``);
    ``None`` describes the current CUDA device, and without one the default serves.
    """
    from prepkit.kernels.decode.variants import DecodeVariant

    pinned = pinned_variants().get(problem.key())
    if pinned is not None:
        return pinned
    try:
        env = Environment.of(device) if device is not None else Environment.current()
    except DeviceError:
        return kernel.default(problem)
    paths = [Path(db)] if db is not None else [user_db_path(), *filter(None, [bundled_db_path()])]
    version = decode_kernel_version(kernel)
    for path in dict.fromkeys(paths):
        if not path.is_file():
            continue
        try:
            name = _read_variant(path, kernel.name, problem.key(), version, env)
        except TacticsError as err:
            warnings.warn(f"ignoring tactics DB: {err}", TacticsDBWarning, stacklevel=2)
            continue
        if name is None:
            continue
        try:
            return DecodeVariant.parse(name)
        except ValueError as err:
            log.warning("%s: decode variant of %s %s cannot be read (%s)", path, kernel.name, problem.key(), err)
    return kernel.default(problem)


def pinned_variants(text: str | None = None) -> dict[str, DecodeVariant]:
    """The variants pinned by :data:`PINNED_ENV` (or ``text``): ``KEY=VARIANT`` entries separated
    by commas, ``KEY`` a problem's :meth:`~prepkit.kernels.decode.variants.DecodeProblem.key`.

    Raises:
        TacticsError: an entry that is not ``KEY=VARIANT`` with a variant name (the message names it).
    """
    from prepkit.kernels.decode.variants import DecodeVariant

    text = os.environ.get(PINNED_ENV, "") if text is None else text
    pinned: dict[str, DecodeVariant] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        key, sep, name = entry.partition("=")
        try:
            if not (sep and key.strip()):
                raise ValueError("not KEY=VARIANT")
            pinned[key.strip()] = DecodeVariant.parse(name.strip())
        except ValueError as err:
            raise TacticsError(f"{PINNED_ENV}: {entry!r}: {err}") from err
    return pinned


def _read_variant(path: Path, kernel: str, problem_key: str, version: str, env: Environment) -> str | None:
    """The variant name of the best matching row of ``path``; ``None`` where none matches or the
    DB predates the decode table."""
    conn, _ = open_readonly(path)
    try:
        has = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (DECODE_WINNER.name,))
        if has.fetchone() is None:
            return None
        rows = conn.execute(
            """
            SELECT d.variant, e.gpu_name, e.triton_version, d.timed_at
            FROM decode_winner d JOIN env e ON e.env_hash = d.env_hash
            WHERE d.kernel = ? AND d.problem_key = ? AND d.kernel_version = ? AND e.cc_major = ? AND e.cc_minor = ?
            """,
            (kernel, problem_key, version, env.cc_major, env.cc_minor),
        ).fetchall()
    except sqlite3.DatabaseError as err:
        raise TacticsError(f"{path}: cannot read decode winners ({err})") from err
    finally:
        conn.close()

    same_triton = [r for r in rows if triton_minor(str(r[2])) == env.triton_minor]
    if not same_triton:
        return None
    # Same GPU model first, then the newest timing.
    same_triton.sort(key=lambda r: str(r[3]), reverse=True)
    same_triton.sort(key=lambda r: r[1] != env.name)
    return str(same_triton[0][0])

"""What ``prepkit env`` reports for a bug report: versions (Python, the OS, packages, CUDA and the
driver), the GPU, the tactics DBs, whether the installed Triton is the one the bundled rows were
measured with, and whether MX runs natively here. Every probe tolerates a missing package or GPU:
the report says so instead."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import sqlite3
from pathlib import Path
from typing import Any

from prepkit import __version__

PACKAGES = ("torch", "triton", "transformers", "huggingface_hub")
NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")  # the loaded kernel module's version (Linux)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def driver_version(version_file: Path = NVIDIA_DRIVER_FILE) -> str | None:
    """The NVIDIA driver's version, read from the kernel module (no GPU library loaded); None
    without one."""
    try:
        text = version_file.read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return found[1] if found else None


def _minor(version: str) -> str:
    """``3.6.0`` -> ``3.6``."""
    return ".".join(version.split(".")[:2])


def measured_triton(path: Path) -> list[str]:
    """The Triton versions (major.minor) the rows of the DB at ``path`` were measured with."""
    from prepkit.errors import TacticsError
    from prepkit.tactics.schema import open_readonly

    try:
        conn, _ = open_readonly(path)
    except TacticsError:
        return []
    try:
        rows = conn.execute("SELECT DISTINCT triton_version FROM env WHERE triton_version != ''").fetchall()
    except sqlite3.DatabaseError:
        return []
    finally:
        conn.close()
    return sorted({_minor(str(v)) for (v,) in rows})


def triton_check(installed: str | None, measured: list[str]) -> dict[str, Any]:
    """Whether the installed Triton is of a minor the bundled rows were measured with: a compiler of
    another minor makes other code, so their timings (which tactic wins) may not hold here."""
    differs = bool(installed and measured and _minor(installed) not in measured)
    return {"installed": installed, "bundled_rows_measured_with": measured, "differs": differs}


def _native_mx_rule() -> Any:
    """The runtime's rule for native block-scaled MX: the one import to change if it moves."""
    from prepkit.runtime.moe import lowers_natively

    return lowers_natively


def _gpu() -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from prepkit.tactics.keys import arch_name

    major, minor = torch.cuda.get_device_capability(0)
    return {"name": torch.cuda.get_device_name(0), "capability": [major, minor], "arch": arch_name(major, minor)}


def installed_kernel_version() -> str | None:
    """The version of the bundled kernel, which names the tactics rows this install serves."""
    try:
        from prepkit.kernels.mx import KERNEL_VERSION
    except ImportError:  # no torch or triton: the kernel cannot be imported at all
        return None
    return str(KERNEL_VERSION)


def _db_rows(path: Path, gpu: dict[str, Any] | None, kernel_version: str | None) -> dict[str, Any]:
    """Winner rows of ``path``: in all, those of this install's kernel version, and of those the
    ones measured on a GPU of this compute capability."""
    from prepkit.errors import TacticsError
    from prepkit.tactics.schema import open_readonly

    out: dict[str, Any] = {"path": str(path), "exists": path.is_file()}
    if not out["exists"]:
        return out
    try:
        conn, _ = open_readonly(path)
    except TacticsError as err:
        return {**out, "error": str(err)}
    try:
        out["winner_rows"] = conn.execute("SELECT COUNT(*) FROM winner").fetchone()[0]
        query = (
            "SELECT COUNT(*) FROM winner w JOIN env e USING (env_hash) JOIN problem p USING (problem_hash) "
            "JOIN kernel k ON k.kernel_hash = p.kernel_hash WHERE k.kernel_version = ?"
        )
        out["rows_for_kernel_version"] = conn.execute(query, (kernel_version,)).fetchone()[0]
        if gpu:
            out["rows_for_this_gpu"] = conn.execute(
                query + " AND e.cc_major = ? AND e.cc_minor = ?", (kernel_version, *gpu["capability"])
            ).fetchone()[0]
    except sqlite3.DatabaseError as err:
        out["error"] = f"cannot read winners ({err})"
    finally:
        conn.close()
    return out


def report() -> dict[str, Any]:
    """Everything ``prepkit env`` prints, as one JSON-ready dict."""
    from prepkit.tactics.lookup import bundled_db_path, user_db_path

    gpu = _gpu()
    versions = {"prepkit": __version__, "python": platform.python_version(), **{p: _version(p) for p in PACKAGES}}
    try:
        import torch

        versions["cuda"] = torch.version.cuda
    except ImportError:
        versions["cuda"] = None
    versions["driver"] = driver_version()
    kernel_version = installed_kernel_version()
    native: bool | None = None
    if gpu and versions["triton"]:
        native = bool(_native_mx_rule()(tuple(gpu["capability"]), versions["triton"]))
    dbs = {"user": _db_rows(user_db_path(), gpu, kernel_version)}
    bundled = bundled_db_path()
    if bundled is not None:
        dbs["bundled"] = _db_rows(bundled, gpu, kernel_version)
    return {
        "versions": versions,
        "os": platform.platform(),
        "triton_vs_bundled": triton_check(versions["triton"], measured_triton(bundled) if bundled else []),
        "gpu": gpu,
        "kernel_version": kernel_version,
        "tactics_dbs": dbs,
        "mx_native": native,
    }

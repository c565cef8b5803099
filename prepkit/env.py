"""What ``prepkit env`` reports for a bug report: versions, the GPU, the tactics DBs and whether MX
runs natively here. Every probe tolerates a missing package or GPU: the report says so instead."""

from __future__ import annotations

import importlib.metadata
import sqlite3
from pathlib import Path
from typing import Any

from prepkit import __version__

PACKAGES = ("torch", "triton", "transformers")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


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
    versions = {"prepkit": __version__, **{p: _version(p) for p in PACKAGES}}
    try:
        import torch

        versions["cuda"] = torch.version.cuda
    except ImportError:
        versions["cuda"] = None
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
        "gpu": gpu,
        "kernel_version": kernel_version,
        "tactics_dbs": dbs,
        "mx_native": native,
    }

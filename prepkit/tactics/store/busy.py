"""What a tactics DB write does while another process holds the file, and the error a failed
write gives, by cause."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

from prepkit.errors import TacticsError

BUSY_TIMEOUT_S = 60.0


def is_busy(err: sqlite3.OperationalError) -> bool:
    text = str(err).lower()
    return "locked" in text or "busy" in text


def write_failure(path: Path | str, err: OSError | sqlite3.Error) -> TacticsError:
    """The error for a tactics DB that cannot be written, by cause: read-only, full, or a path
    that cannot be a file; each names ``path``."""
    text = str(err).lower()
    code = getattr(err, "errno", None)
    if code in (errno.EROFS, errno.EACCES, errno.EPERM) or "readonly" in text or "read-only" in text:
        return TacticsError(
            f"{path}: cannot be written, it is read-only ({err})",
            hint="pass --db a writable path; `tactics show` and `export` read it as it is",
        )
    if code == errno.ENOSPC or "disk is full" in text:
        return TacticsError(
            f"{path}: no space left on the device while writing it",
            hint="free disk space and run it again: an interrupted write leaves the DB as it was",
        )
    if code in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        return TacticsError(
            f"{path}: cannot be created there: a part of the path is a file, not a folder ({err})",
            hint="pass --db a path inside a folder",
        )
    return TacticsError(f"{path}: cannot be written ({err})", hint="check the path and its permissions")

"""One exception hierarchy. Each class carries its exit code and what that code means; the CLI's
exit-code table (``--help`` and the README) is generated from them (:mod:`prepkit.exit_codes`), so
a new class needs no other edit. A subclass inherits both, or sets its own."""

from __future__ import annotations


class PrepkitError(Exception):
    """Base of every error prepkit raises on purpose (bad input, not a bug)."""

    exit_code = 1
    # "<what failed>: <the cases>"; classes that share a code share the part before the colon.
    exit_meaning = "error"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class RecipeError(PrepkitError):
    """A recipe, a model config or arguments that do not fit together."""

    exit_code = 3
    exit_meaning = "bad input: recipe, model config or option values"


class CheckpointError(PrepkitError):
    """Missing, truncated or malformed source files or tensors."""

    exit_code = 3
    exit_meaning = "bad input: checkpoint files or tensors"


class LayoutError(PrepkitError):
    """An unknown layout, or a TP/EP split the layout cannot express."""

    exit_code = 3
    exit_meaning = "bad input: layout or TP/EP split"


class LaunchError(PrepkitError):
    """A multi-process run whose processes do not fit the prepared set or each other: the world
    size, a rank's shards, the prepared set each rank opened, a GPU two ranks share."""

    exit_code = 3
    exit_meaning = "bad input: a multi-process launch that does not fit the prepared set"


class OutputError(PrepkitError):
    """The output folder cannot be used (foreign content, no space, not writable)."""

    exit_code = 3
    exit_meaning = "bad input: output folder (foreign, full, read-only, or held by another run)"


class FetchError(PrepkitError):
    """Hub, network or download-disk problems."""

    exit_code = 4
    exit_meaning = "fetch failed: hub, network or download disk (or folder held by another fetch)"


class DeviceError(PrepkitError):
    """No GPU, or a GPU of the wrong compute capability."""

    exit_code = 5
    exit_meaning = "device problem: no GPU, or a GPU of another compute capability"


class VerifyError(PrepkitError):
    """Hash, round-trip or manifest mismatch."""

    exit_code = 6
    exit_meaning = "verification failed: hash, round trip or manifest mismatch"


class CompileCheckError(PrepkitError):
    """A default kernel that failed the compile-only check for a GPU architecture (a check that
    failed, as for verify: the same exit code)."""

    exit_code = 6
    exit_meaning = "verification failed: a default kernel failed the compile-only check"


class DependencyError(PrepkitError):
    """An optional package a command needs is missing, or of a version prepkit does not support
    (bad input to fix by installing, as for a recipe: the same exit code)."""

    exit_code = 3
    exit_meaning = "bad input: an optional package missing or of an unsupported version"


class TacticsError(PrepkitError):
    """A tactic database that is corrupt, foreign or of a newer schema."""

    exit_code = 3
    exit_meaning = "bad input: tactics DB or export (or held by another merge)"


class PathError(PrepkitError):
    """A path the file system refuses as spelled: a name longer than it allows."""

    exit_code = 3
    exit_meaning = "bad input: a path the file system refuses (a name too long)"

    @classmethod
    def name_too_long(cls, path: object) -> PathError:
        """The error for ENAMETOOLONG on ``path``, naming the part at fault."""
        import os

        parts = str(path).split(os.sep)
        longest = max(parts, key=lambda part: len(os.fsencode(part)), default="")
        size = len(os.fsencode(longest))
        detail = (
            f"a name of {size} bytes in it is too long for the file system (most allow 255 a name)"
            if size > 255
            else "the path is too long for the file system"
        )
        return cls(
            f"{path}: {detail}",
            hint="choose a shorter name (--out, --db, PREPKIT_TACTICS_DB or the folder given)",
        )

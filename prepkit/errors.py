"""One exception hierarchy; the CLI maps each class to an exit code in one place."""

from __future__ import annotations


class PrepkitError(Exception):
    """Base of every error prepkit raises on purpose (bad input, not a bug)."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class RecipeError(PrepkitError):
    """A recipe, a model config or arguments that do not fit together."""

    exit_code = 3


class CheckpointError(PrepkitError):
    """Missing, truncated or malformed source files or tensors."""

    exit_code = 3


class LayoutError(PrepkitError):
    """An unknown layout, or a TP/EP split the layout cannot express."""

    exit_code = 3


class OutputError(PrepkitError):
    """The output folder cannot be used (foreign content, no space, not writable)."""

    exit_code = 3


class FetchError(PrepkitError):
    """Hub, network or download-disk problems."""

    exit_code = 4


class DeviceError(PrepkitError):
    """No GPU, or a GPU of the wrong compute capability."""

    exit_code = 5


class VerifyError(PrepkitError):
    """Hash, round-trip or manifest mismatch."""

    exit_code = 6


class CompileCheckError(PrepkitError):
    """A default kernel that failed the compile-only check for a GPU architecture (a check that
    failed, as for verify: the same exit code)."""

    exit_code = 6


class DependencyError(PrepkitError):
    """An optional package a command needs is missing, or of a version prepkit does not support
    (bad input to fix by installing, as for a recipe: the same exit code)."""

    exit_code = 3


class TacticsError(PrepkitError):
    """A tactic database that is corrupt, foreign or of a newer schema."""

    exit_code = 3

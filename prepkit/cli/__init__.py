"""The ``prepkit`` command line: a click group; each command lives in its own module."""

from __future__ import annotations

from prepkit.cli._app import cli, main

# Importing a command module registers its command on ``cli``.
from prepkit.cli import fetch as _fetch  # noqa: F401,E402  isort: skip
from prepkit.cli import prepare as _prepare  # noqa: F401,E402  isort: skip
from prepkit.cli import synth as _synth  # noqa: F401,E402  isort: skip
from prepkit.cli import tactics as _tactics  # noqa: F401,E402  isort: skip
from prepkit.cli import tune as _tune  # noqa: F401,E402  isort: skip
from prepkit.cli import verify as _verify  # noqa: F401,E402  isort: skip

__all__ = ["cli", "main"]

"""The ``prepkit`` command line: a click group; each command lives in its own module, which the
group imports when the command is used (see ``prepkit.cli._app.COMMANDS``)."""

from __future__ import annotations

from prepkit.cli._app import cli, main

__all__ = ["cli", "main"]

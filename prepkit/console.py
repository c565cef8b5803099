"""The rich consoles (results on stdout, diagnostics and progress on stderr) and the progress
adapter; only the CLI imports this module."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

err_console = Console(stderr=True, highlight=False)
# Results (tables, plans, summaries) go to stdout so they can be piped and grepped.
out_console = Console(highlight=False)

ProgressFn = Callable[[str, int, int], None]


@contextmanager
def progress(
    enabled: bool = True, *, transient: bool = False, unit: Literal["bytes", "count"] = "bytes"
) -> Iterator[ProgressFn]:
    """Yield an ``on_progress(label, done, total)`` callback drawn as rich bars: bytes with their
    speed, or (``unit="count"``) done/total counts with an ETA.

    One bar per label; rich draws nothing live when stderr is not a terminal.
    """
    if not enabled:
        yield lambda label, done, total: None
        return
    if unit == "bytes":
        columns = (DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    else:
        columns = (MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    bars = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        *columns,
        console=err_console,
        transient=transient,
    )
    tasks: dict[str, TaskID] = {}

    def on_progress(label: str, done: int, total: int) -> None:
        if label not in tasks:
            tasks[label] = bars.add_task(label, total=total)
        bars.update(tasks[label], completed=done, total=total)

    with bars:
        yield on_progress


def info(message: str) -> None:
    # soft_wrap: a log line off a terminal stays one line instead of breaking at 80 columns
    err_console.print(message, soft_wrap=not err_console.is_terminal)


def result(renderable: Any) -> None:
    """Print a result (a table or a line) on stdout."""
    out_console.print(renderable)


def warn(message: str) -> None:
    err_console.print(f"[yellow]Warning:[/] {message}", soft_wrap=not err_console.is_terminal)


def emit_json(payload: Any) -> None:
    """Results go to stdout, so ``--json | jq`` works."""
    sys.stdout.write(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()

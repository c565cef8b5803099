"""The rich consoles (results on stdout, diagnostics and progress on stderr) and the progress
adapter; only the CLI imports this module."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from prepkit.fsutil import format_bytes, format_duration


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader of stdout left (``prepkit ... | head -1``): it has what it wanted, so the
        command ends quietly with 0 (rich's own answer is exit 1, which prepkit keeps for bugs)."""
        silence_stdout()
        raise SystemExit(0)


def silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush into a closed pipe is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no real file descriptor (a test's captured stdout)
        pass


err_console = _Console(stderr=True, highlight=False)
# Results (tables, plans, summaries) go to stdout so they can be piped and grepped.
out_console = _Console(highlight=False)

ProgressFn = Callable[[str, int, int], None]


# Seconds between progress lines when stderr is not a terminal (nohup, CI, ssh | tee).
PROGRESS_INTERVAL_ENV = "PREPKIT_PROGRESS_INTERVAL"
DEFAULT_PROGRESS_INTERVAL = 10.0


def progress_interval() -> float:
    """$PREPKIT_PROGRESS_INTERVAL in seconds (0: every update), else the default of 10 s."""
    try:
        value = float(os.environ.get(PROGRESS_INTERVAL_ENV, ""))
    except ValueError:
        return DEFAULT_PROGRESS_INTERVAL
    return value if value >= 0 else DEFAULT_PROGRESS_INTERVAL


@contextmanager
def progress(
    enabled: bool = True,
    *,
    transient: bool = False,
    unit: Literal["bytes", "count"] = "bytes",
    log_labels: Collection[str] | None = None,
    eta: bool = False,
) -> Iterator[ProgressFn]:
    """Yield an ``on_progress(label, done, total)`` callback drawn as rich bars: bytes with their
    speed, or (``unit="count"``) done/total counts with an ETA.

    One bar per label on a terminal. Elsewhere (where rich draws nothing live) plain lines, one
    per label that moved, every :func:`progress_interval` seconds; ``log_labels`` limits those
    lines to the labels named (e.g. a total, not every file). A byte line says the time left, from
    the rate observed since the label's first update; ``eta`` adds it to count lines too (and
    starts a count bar at the work already done).
    """
    if not enabled:
        yield lambda label, done, total: None
        return
    if not err_console.is_terminal:
        yield _ProgressLines(unit, progress_interval(), log_labels, eta=eta).update
        return
    columns: tuple[ProgressColumn, ...]
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
            # with eta, work done before the first update (reused) starts the bar, not its speed
            tasks[label] = bars.add_task(label, total=total, completed=done if eta else 0)
        bars.update(tasks[label], completed=done, total=total)

    with bars:
        yield on_progress


class _ProgressLines:
    """Progress off a terminal: at most one batch of plain lines on stderr per interval, one line
    per label that moved since the last batch, so a log shows a long run is alive."""

    def __init__(self, unit: str, interval: float, labels: Collection[str] | None, *, eta: bool = False) -> None:
        self.unit = unit
        self.interval = interval
        self.labels = labels
        self.eta = eta
        self.started = self.printed = time.monotonic()
        self.latest: dict[str, tuple[int, int]] = {}
        self.first: dict[str, tuple[int, float]] = {}  # a label's first update: (done, when)
        self.moved: dict[str, None] = {}  # an ordered set: the labels in the order they moved
        self.lock = threading.Lock()  # fetch reports from many threads

    def update(self, label: str, done: int, total: int) -> None:
        if self.labels is not None and label not in self.labels:
            return
        with self.lock:
            now = time.monotonic()
            self.latest[label] = (done, total)
            self.first.setdefault(label, (done, now))
            self.moved[label] = None
            if now - self.printed < self.interval:
                return
            self.printed = now
            for moved in self.moved:
                err_console.print(Text(self.line(moved, now - self.started)), soft_wrap=True)
            self.moved.clear()

    def line(self, label: str, elapsed: float) -> str:
        """``source: 1.2 GiB / 4.0 GiB (30%), 120.5 MiB/s, 10 s elapsed, about 28 s left``: a byte
        line always estimates the time left (a log has no bar to read it from)."""
        done, total = self.latest[label]
        share = f" ({100 * done // total}%)" if total > 0 else ""
        if self.unit == "bytes":
            rate = f", {format_bytes(done / elapsed)}/s" if elapsed > 0 else ""
            line = f"{label}: {format_bytes(done)} / {format_bytes(total)}{share}{rate}, {elapsed:.0f} s elapsed"
            return line + self.left(label)
        return f"{label}: {done}/{total}{share}, {elapsed:.0f} s elapsed" + (self.left(label) if self.eta else "")

    def left(self, label: str) -> str:
        """``, about 1 h 05 min left``: what is left at the rate seen since the label's first update
        (work reused from an earlier run counts as done, not as speed); empty before any progress."""
        done, total = self.latest[label]
        done0, t0 = self.first[label]
        spent = time.monotonic() - t0
        if done <= done0 or spent <= 0 or total <= done:
            return ""
        return f", about {format_duration((total - done) * spent / (done - done0))} left"


# ``-q``: no progress and no info lines on stderr; results (stdout), warnings and errors still print.
_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


# Whether the running command was given --json, and whether it printed its JSON already: an
# error is then printed as a JSON object too, unless stdout holds a document already.
_json = False
_json_printed = False


def set_json(requested: bool) -> None:
    global _json, _json_printed
    _json, _json_printed = requested, False


def json_emitted() -> bool:
    """Whether the running command printed its JSON document already."""
    return _json_printed


def json_requested() -> bool:
    """Whether an error should be printed as a JSON object on stdout."""
    return _json and not _json_printed


def _text(message: str | RenderableType, label: str = "", style: str = "") -> RenderableType:
    """A message as text, never as markup: ``pip install 'prepkit-gpt-oss[plot]'`` prints whole."""
    if not isinstance(message, str):
        return message
    return Text.assemble((label, style), " ", message) if label else Text(message)


def info(message: str | RenderableType, *, label: str = "", style: str = "") -> None:
    """A diagnostic line (or table) on stderr; ``label`` is drawn in ``style`` before it."""
    if not _quiet:
        # soft_wrap: a log line off a terminal stays one line instead of breaking at 80 columns
        err_console.print(_text(message, label, style), soft_wrap=not err_console.is_terminal)


def result(renderable: str | RenderableType, *, label: str = "", style: str = "") -> None:
    """Print a result (a table or a line) on stdout; off a terminal a line stays one line."""
    text = isinstance(renderable, str | Text)
    out_console.print(_text(renderable, label, style), soft_wrap=text and not out_console.is_terminal)


def warn(message: str) -> None:
    err_console.print(_text(message, "Warning:", "yellow"), soft_wrap=not err_console.is_terminal)


def error(message: str, hint: str | None = None, *, debug_note: bool = True) -> None:
    """An error, its hint, and how to see the traceback, on stderr."""
    err_console.print(_text(message, "Error:", "bold red"), soft_wrap=True)
    if hint:
        err_console.print(_text(hint, "Hint:", "dim"), soft_wrap=True)
    if debug_note:
        err_console.print(Text("(run with --debug or PREPKIT_DEBUG=1 for the traceback)", style="dim"))


def json_text(payload: Any) -> str:
    """The one JSON style of every command, for stdout and for report files alike."""
    return json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n"


def emit_json(payload: Any) -> None:
    """Results go to stdout, so ``--json | jq`` works."""
    global _json_printed
    _json_printed = True
    sys.stdout.write(json_text(payload))
    sys.stdout.flush()

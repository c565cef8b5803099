"""Options shared by several commands, defined once so they are spelled the same everywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

F = Callable[..., Any]


def model_option(f: F) -> F:
    return click.option(
        "--model",
        "model",
        default="gpt-oss-120b",
        show_default=True,
        help="Recipe name (gpt-oss-120b, gpt-oss-20b), hub id, or path to a recipe JSON.",
    )(f)


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")(f)


def quiet_option(f: F) -> F:
    return click.option("--quiet", "-q", is_flag=True, help="No progress bars.")(f)

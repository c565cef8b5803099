"""The exit codes of ``prepkit``: the fixed ones, then one per code that the error classes of
:mod:`prepkit.errors` carry, found by walking the class hierarchy (a new class appears here by
itself). ``prepkit --help`` prints :func:`epilog`; a test keeps the README's table equal to
:func:`markdown_table`."""

from __future__ import annotations

from prepkit.errors import PrepkitError

# Codes that no error class carries: success, a bug, click's usage errors, Ctrl-C.
FIXED: dict[int, str] = {
    0: "success",
    1: "internal error (a bug: the traceback is shown)",
    2: "usage error: an unknown or bad option",
    130: "interrupted (Ctrl-C)",
}


def _subclasses(cls: type[PrepkitError]) -> list[type[PrepkitError]]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _join(meanings: list[str]) -> str:
    """``["bad input: a", "bad input: b"]`` -> ``"bad input: a; b"``."""
    heads = {m.partition(": ")[0] for m in meanings}
    if len(heads) == 1 and all(": " in m for m in meanings):
        return f"{heads.pop()}: " + "; ".join(m.partition(": ")[2] for m in meanings)
    return "; ".join(meanings)


def table() -> list[tuple[int, str]]:
    """``(code, meaning)`` for every exit code, in code order."""
    by_code: dict[int, list[str]] = {}
    for cls in _subclasses(PrepkitError):
        meanings = by_code.setdefault(cls.exit_code, [])
        if cls.exit_meaning not in meanings:
            meanings.append(cls.exit_meaning)
    rows = dict(FIXED)
    for code, meanings in by_code.items():
        if code not in FIXED:
            rows[code] = _join(meanings)
    return sorted(rows.items())


def epilog() -> str:
    """The ``Exit codes:`` block of ``prepkit --help`` (``\\b`` keeps click from rewrapping it)."""
    return "\b\nExit codes:\n" + "".join(f"  {code:<3} {meaning}\n" for code, meaning in table())


def markdown_table() -> str:
    """The README's table."""
    return "| code | meaning |\n|---|---|\n" + "".join(f"| {code} | {meaning} |\n" for code, meaning in table())

"""Launch plans replay only what :mod:`._record` saw: every launch and every zeroing of the kernel
package must go through ``_record.launch`` / ``_record.zero``. Read from the source, so a new
launcher that calls ``kernel[grid](...)`` or ``tensor.zero_()`` itself fails here, not in a replay
on a GPU that silently skips its launch."""

from __future__ import annotations

import ast
from pathlib import Path

import prepkit.kernels.mx as kernel_package

PACKAGE = Path(kernel_package.__file__).parent
# The recorder itself, and the plan's replay of the zeroings it recorded.
ALLOWED = {"_record.py": {"launch", "zero"}, "plan.py": {"__call__"}}


def _direct_calls(source: str) -> list[tuple[str, int, str]]:
    """(enclosing function, line, what) of each ``x[...](...)`` and ``.zero_()`` call."""
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else func
            if isinstance(child, ast.Call):
                if isinstance(child.func, ast.Subscript):
                    found.append((name, child.lineno, "kernel[grid](...)"))
                elif isinstance(child.func, ast.Attribute) and child.func.attr == "zero_":
                    found.append((name, child.lineno, ".zero_()"))
            visit(child, name)

    visit(ast.parse(source), "<module>")
    return found


def test_the_scanner_sees_both_forms() -> None:
    src = "def f(k, g, t):\n    k[g](1, 2)\n    t.zero_()\n"
    assert _direct_calls(src) == [("f", 2, "kernel[grid](...)"), ("f", 3, ".zero_()")]


def test_every_launch_and_zeroing_goes_through_record() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert any(f.name == "launch.py" for f in files)
    bad = []
    for path in files:
        for func, line, what in _direct_calls(path.read_text()):
            if func not in ALLOWED.get(path.name, set()):
                bad.append(f"{path.name}:{line} in {func}: {what} bypasses _record.launch/_record.zero")
    assert not bad, "\n".join(bad)

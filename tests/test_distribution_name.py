"""prepkit is published under a name of its own (``prepkit`` on the index is another project): every
install line the code prints or the docs show names the distribution of pyproject.toml."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prepkit.distribution import DISTRIBUTION, install_hint

ROOT = Path(__file__).resolve().parents[1]

# `pip install [-U ...] SPEC`: SPEC is a name, a quoted name with extras, a wheel path or a folder.
PIP_LINE = re.compile(r"pip install((?:\s+-[-\w]+)*)\s+['\"]?([^\s'\"`\[]+)")


def _pyproject_name() -> str:
    """``[project] name`` (read by hand: tomllib is not in Python 3.10's standard library)."""
    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    found = re.search(r'^name\s*=\s*"([^"]+)"', project, re.MULTILINE)
    assert found, "pyproject.toml: [project] has no name"
    return found[1]


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wrong_specs(text: str, dist: str) -> list[str]:
    """Every ``pip install`` target in ``text`` that names prepkit by another distribution name."""
    wrong = []
    for match in PIP_LINE.finditer(text):
        spec = match[2]
        if spec.startswith(".") or spec.startswith("{"):  # a source folder, or a name filled in by code
            continue
        wheel = re.match(r"(?:.*/)?([^/]+?)-\d[^/]*\.whl$", spec)
        name = wheel[1] if wheel else spec
        if _normalized(name).startswith("prepkit") and _normalized(name) != _normalized(dist):
            wrong.append(match[0])
        # a wheel file spells the name with underscores (the wheel spec's normal form)
        if wheel and _normalized(name) == _normalized(dist) and name != dist.replace("-", "_"):
            wrong.append(match[0])
    return wrong


def test_the_distribution_constant_is_the_pyproject_name() -> None:
    name = _pyproject_name()
    assert name == DISTRIBUTION
    assert _normalized(name) != "prepkit", "`prepkit` on the package index is an unrelated project"


def test_install_hints_spell_the_distribution() -> None:
    assert install_hint("gpu") == f"pip install '{_pyproject_name()}[gpu]'"
    assert install_hint() == f"pip install {_pyproject_name()}"
    assert install_hint(upgrade=True) == f"pip install -U {_pyproject_name()}"


def _scanned_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / ".ci" / "wheel-check", ROOT / ".ci" / "run"]
    for folder, pattern in (("prepkit", "*.py"), ("docs", "*.md"), ("tests", "*.py"), ("benchmarks", "*.py")):
        files += sorted((ROOT / folder).rglob(pattern))
    return [f for f in files if f.resolve() != Path(__file__).resolve()]


@pytest.mark.parametrize("path", _scanned_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_install_line_names_another_distribution(path: Path) -> None:
    wrong = _wrong_specs(path.read_text(), _pyproject_name())
    assert not wrong, f"{path.relative_to(ROOT)}: {wrong} (the distribution is {_pyproject_name()!r})"


@pytest.mark.parametrize(
    ("line", "bad"),
    [
        ("pip install 'prepkit[gpu]'", True),
        ("pip install -U prepkit", True),
        ("pip install dist/prepkit-0.1.0-py3-none-any.whl", True),
        ("pip install 'prepkit-gpt-oss[plot]'", False),
        ("pip install 'dist/prepkit_gpt_oss-0.1.0-py3-none-any.whl[gpu]'", False),
        ("pip install -e '.[gpu]'", False),
        ("pip install torch==2.13.0", False),
    ],
)
def test_the_scan_tells_names_apart(line: str, bad: bool) -> None:
    assert bool(_wrong_specs(line, "prepkit-gpt-oss")) is bad


def test_the_wheel_check_looks_for_the_distributions_wheel() -> None:
    text = (ROOT / ".ci" / "wheel-check").read_text()
    assert f"dist/{_pyproject_name().replace('-', '_')}-*.whl" in text


def test_the_torch_floor_is_the_oldest_tested() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    floors = re.findall(r'"torch>=([\d.]+)"', text)
    assert floors == ["2.11"], floors  # the GPU hosts' torch; nothing older was ever run


@pytest.mark.parametrize("path", _scanned_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_wheel_glob_looks_for_another_name(path: Path) -> None:
    # a wheel file spells the distribution with underscores: prepkit_gpt_oss-0.1.0-py3-none-any.whl
    assert "prepkit-*.whl" not in path.read_text(), f"{path.relative_to(ROOT)} looks for a wheel of another name"

"""The files prepkit ships: recipes/ and tactics.db at the repository top, found there from a source
checkout, copied into the wheel's prepkit/data/ by the build, and the ``PREPKIT_RECIPES`` override.
(``.ci/wheel-check`` installs the real wheel and runs it from an unrelated folder.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import prepkit
from prepkit import data, recipes
from prepkit.distribution import DISTRIBUTION
from prepkit.tactics.lookup import bundled_db_path

PKG = Path(prepkit.__file__).resolve().parent
ROOT = PKG.parent


def _tracked(*paths: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--", *paths], capture_output=True, text=True, cwd=ROOT, check=True)
    return sorted(out.stdout.split())


def test_a_source_checkout_reads_the_recipes_and_the_db_at_the_top() -> None:
    # this tree is imported from source (PYTHONPATH or an editable install): no package copy exists
    assert data.recipes_dir() == ROOT / "recipes" and data.recipes_dir().is_dir()
    assert data.tactics_db() == ROOT / "tactics.db" and data.tactics_db().is_file()
    assert data.recipes_dir() == recipes.recipes_root()  # no PREPKIT_RECIPES in the test environment
    names = recipes.available()
    assert {"gpt-oss-120b", "gpt-oss-20b"} <= set(names)
    for name in names:
        assert recipes.load_recipe(name).path.parent == data.recipes_dir()
    assert bundled_db_path() == data.tactics_db()
    # one copy only: nothing inside the package for the checkout to drift from
    assert not (PKG / "data" / "recipes").exists() and not (PKG / "data" / "tactics.db").exists()


def test_git_holds_each_shipped_file_once_at_the_top() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert _tracked("recipes", "tactics.db") == ["recipes/gpt-oss-120b.json", "recipes/gpt-oss-20b.json", "tactics.db"]
    assert _tracked("prepkit/data") == ["prepkit/data/__init__.py"]


def test_pyproject_builds_with_the_step_that_ships_the_root_files() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["cmdclass"] == {"build_py": "tools.ship_data.BuildPyWithRootData"}
    assert project["project"]["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()


@pytest.mark.slow
def test_the_built_wheel_carries_and_serves_the_root_files(tmp_path: Path) -> None:
    """Build the wheel from a copy of the tree, then import prepkit from the wheel file itself (a zip)
    in an unrelated folder: the recipes and the DB come out of the wheel, byte for byte the top's,
    as real paths (SQLite opens only real files, so a zip-imported package extracts them)."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__")
    for name in ["pyproject.toml", "README.md", "LICENSE", "tactics.db", "recipes", "tools", "prepkit"]:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=skip)
        else:
            shutil.copy2(ROOT / name, src / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(src),
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob(f"{DISTRIBUTION.replace('-', '_')}-*.whl")  # the wheel spells the name so
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {
        "prepkit/data/tactics.db",
        "prepkit/data/recipes/gpt-oss-120b.json",
        "prepkit/data/recipes/gpt-oss-20b.json",
    }
    assert shipped <= names and not any(n.startswith(("recipes/", "tactics.db", "tools/")) for n in names)
    code = (
        "import sqlite3, sys, prepkit.data as d\n"
        "assert '.whl' in d.__file__, d.__file__\n"
        "db = d.tactics_db()\n"
        "winners = sqlite3.connect(f'file:{db}?mode=ro', uri=True).execute('select count(*) from winner')\n"
        "print(db.is_file(), winners.fetchone()[0] > 0)\n"
        "print(sorted(p.name for p in d.recipes_dir().glob('*.json')))\n"
        "sys.stdout.buffer.write(db.read_bytes()[:4096])\n"
    )
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(wheel)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, cwd=workdir, check=False)
    assert out.returncode == 0, out.stderr.decode()
    first, second, db_head = out.stdout.split(b"\n", 2)
    assert first == b"True True"
    assert second == b"['gpt-oss-120b.json', 'gpt-oss-20b.json']"
    assert db_head == (ROOT / "tactics.db").read_bytes()[:4096]


def test_prepkit_recipes_overrides_the_packaged_folder(tmp_path: Path) -> None:
    mine = tmp_path / "recipes"
    mine.mkdir()
    raw = json.loads((data.recipes_dir() / "gpt-oss-20b.json").read_text())
    (mine / "my-model.json").write_text(json.dumps({**raw, "name": "my-model"}))
    code = (
        "from prepkit import recipes\n"
        "print(recipes.available(), recipes.load_recipe('my-model').name)\n"
        "try:\n"
        "    recipes.load_recipe('gpt-oss-120b')\n"
        "except Exception as err:\n"
        "    print(type(err).__name__, err, '|', err.hint)\n"
    )
    env = {**os.environ, "PREPKIT_RECIPES": str(mine), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    lines = out.stdout.splitlines()
    assert lines[0] == "['my-model'] my-model"
    assert lines[1] == (
        f"RecipeError no recipe 'gpt-oss-120b' in {mine} | known models: my-model; the folder is set by PREPKIT_RECIPES"
    )


def test_the_cli_finds_the_recipes_from_any_folder(tmp_path: Path) -> None:
    """Run from a folder that is not the repository: the recipe still resolves."""
    env = {k: v for k, v in os.environ.items() if k != "PREPKIT_RECIPES"}
    env["PYTHONPATH"] = str(ROOT)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    code = "from prepkit import recipes; r = recipes.load_recipe('openai/gpt-oss-120b'); print(r.name, r.repo_id)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=workdir)
    assert out.stdout.split() == ["gpt-oss-120b", "openai/gpt-oss-120b"]


def test_the_recipes_folder_is_read_at_call_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "only-this.json").write_text((ROOT / "recipes" / "gpt-oss-20b.json").read_text())
    monkeypatch.setenv(recipes.RECIPES_ENV, str(tmp_path))
    assert recipes.available() == ["only-this"]
    monkeypatch.delenv(recipes.RECIPES_ENV)
    assert "gpt-oss-120b" in recipes.available()

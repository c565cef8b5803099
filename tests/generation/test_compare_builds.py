"""``benchmarks.compare_builds``: two builds of prepkit on one prepared folder, the older one
written out of git, both reading one tactics DB, fitted per layer; and the refusal when the
builds ran different MoE tactics."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import compare_builds as cb

from .conftest import DEVICE


def _git_ok() -> bool:
    done = subprocess.run(["git", "-C", str(cb.REPO), "rev-parse", "HEAD"], capture_output=True)
    return done.returncode == 0


needs_git = pytest.mark.skipif(not _git_ok(), reason="needs the project's git history")


@needs_git
def test_a_revision_becomes_a_tree_that_finds_its_tactics_db(tmp_path: Path) -> None:
    tree = cb.materialize("HEAD", tmp_path / "base")
    assert (tree / "prepkit" / "__init__.py").is_file() and (tree / "pyproject.toml").is_file()
    assert (tree / "tactics.db").read_bytes() == subprocess.run(
        ["git", "-C", str(cb.REPO), "show", "HEAD:tactics.db"], capture_output=True, check=True
    ).stdout
    # prepkit.data, imported from that tree, finds the DB at the tree's top (not this checkout's).
    found = subprocess.run(
        [sys.executable, "-c", "from prepkit.data import tactics_db; print(tactics_db())"],
        cwd=tree, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip
    assert Path(found.stdout.strip()) == tree / "tactics.db"


@needs_git
def test_an_unknown_revision_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="cannot read revision 'no-such-rev'"):
        cb.materialize("no-such-rev", tmp_path / "x")


def test_a_folder_becomes_a_copied_tree_without_caches(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "prepkit" / "__pycache__").mkdir(parents=True)
    (src / "prepkit" / "__init__.py").write_text("x = 1\n")
    (src / "prepkit" / "__pycache__" / "a.pyc").write_bytes(b"stale")
    (src / "tactics.db").write_bytes(b"db")
    (src / "unrelated.txt").write_text("not a build file")
    tree = cb.build_tree(str(src), tmp_path / "base")
    assert (tree / "prepkit" / "__init__.py").read_text() == "x = 1\n"
    assert (tree / "tactics.db").read_bytes() == b"db"
    assert not (tree / "prepkit" / "__pycache__").exists() and not (tree / "unrelated.txt").exists()
    (tree / "tactics.db").write_bytes(b"shared")  # sharing the DB later leaves the source alone
    assert (src / "tactics.db").read_bytes() == b"db"
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="holds no prepkit package"):
        cb.build_tree(str(tmp_path / "empty"), tmp_path / "other")


def test_sharing_a_missing_tactics_db_is_one_clear_error(tmp_path: Path) -> None:
    build = cb.Build("base", "r1", tmp_path)
    with pytest.raises(SystemExit, match="no tactics DB to share"):
        cb.share_tactics([build], tmp_path / "absent.db")
    source = tmp_path / "shared.db"
    source.write_bytes(b"db")
    other = cb.Build("head", "r2", tmp_path / "other")
    other.tree.mkdir()
    cb.share_tactics([build, other], source)
    assert (other.tree / "tactics.db").read_bytes() == b"db" and (tmp_path / "tactics.db").read_bytes() == b"db"


def test_different_tactics_are_named_per_token_count() -> None:
    base = {"tactics": {"1": "default: a / b", "512": "tuned: c / d"}}
    head = {"tactics": {"1": "tuned: e / f", "512": "tuned: c / d"}}
    assert cb.different_tactics(base, head) == ["1 tokens: base 'default: a / b', head 'tuned: e / f'"]
    assert cb.different_tactics(head, head) == []


def _report(layers: int, ms: float, tactics: str) -> dict:
    return {
        "model": {"layers": layers},
        "tests": [{"test": "tg16", "batch": 1, "tok_s": {"median": 1e3 / ms}}],
        "bytes_per_token": {"experts": 4e6 * layers, "attention": 1e6 * layers, "head": 2e6},
        "copy_bandwidth_gb_s": 1000.0,
        "tactics": {"1": tactics},
    }


def test_rounds_alternate_the_builds_and_a_tactics_clash_stops_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    builds = [cb.Build("base", "r1", Path("/base")), cb.Build("head", "r2", Path("/head"))]
    calls: list[tuple[str, int]] = []
    slope = {"base": 0.2, "head": 0.1}  # ms a layer

    def fake_bench(build: cb.Build, folder: Path, layers: int, args: argparse.Namespace) -> dict:
        calls.append((build.name, layers))
        return _report(layers, 1.0 + slope[build.name] * layers, "tuned: x" if build.name == "head" else args.base_t)

    monkeypatch.setattr(cb, "bench", fake_bench)
    args = argparse.Namespace(rounds=2, folder=Path("f"), tg=16, allow_different_tactics=False, base_t="tuned: x")
    rounds, reports = cb.compare(builds, [4, 2], args)
    assert calls == [
        ("base", 4),
        ("head", 4),
        ("base", 2),
        ("head", 2),
        ("head", 4),
        ("base", 4),
        ("head", 2),
        ("base", 2),
    ]
    summary = cb.summarize(rounds)
    assert summary["base"]["per_layer_us"] == pytest.approx(200.0) and summary["head"]["per_layer_us"] == pytest.approx(
        100.0
    )
    assert summary["head"]["fixed_ms"] == pytest.approx(1.0)
    assert len(reports) == 2 and set(reports[0]) == {"base L4", "head L4", "base L2", "head L2"}
    # Each round keeps both counts' tok/s: the head is faster at both in both rounds.
    assert rounds[1]["head"]["tok_s_at"] == {4: pytest.approx(1e3 / 1.4), 2: pytest.approx(1e3 / 1.2)}
    assert cb.verdict(rounds) == "faster"
    assert cb.round_lines(rounds)[0] == "round 1: head/base per layer 0.500; tok/s 4 layers 1.286, 2 layers 1.167"
    args.base_t = "default: y"
    with pytest.raises(cb.TacticsDiffer, match="1 tokens: base 'default: y'"):
        cb.compare(builds, [4, 2], args)
    args.allow_different_tactics = True
    assert len(cb.compare(builds, [4, 2], args)[0]) == 2


def _round(base: dict[int, float], head: dict[int, float]) -> dict[str, dict]:
    return {"base": {"per_layer_us": 50.0, "tok_s_at": base}, "head": {"per_layer_us": 49.0, "tok_s_at": head}}


def test_a_head_is_faster_or_slower_only_at_both_counts_in_every_round() -> None:
    # The per-layer fit of one build drifts between runs: a better fit alone is no verdict.
    faster = _round({4: 2800.0, 2: 4000.0}, {4: 2810.0, 2: 4005.0})
    slower = _round({4: 2800.0, 2: 4000.0}, {4: 2790.0, 2: 3990.0})
    mixed = _round({4: 2800.0, 2: 4000.0}, {4: 2840.0, 2: 3999.0})
    assert cb.verdict([faster, faster]) == "faster"
    assert cb.verdict([slower]) == "slower"
    assert cb.verdict([faster, slower]) == "not told apart"
    assert cb.verdict([mixed]) == "not told apart"
    assert cb.verdict([_round({4: 2800.0, 2: 4000.0}, {4: 2800.0, 2: 4001.0})]) == "not told apart"
    summary = cb.summarize([{k: {**v, **FIT} for k, v in r.items()} for r in (faster, slower)])
    builds = [cb.Build("base", "b", Path("/b")), cb.Build("head", "h", Path("/h"))]
    text = cb.table(summary, builds, [faster, slower])
    assert "round 2: head/base per layer 0.980; tok/s 4 layers 0.996, 2 layers 0.998" in text
    assert text.splitlines()[-1].startswith("head against base: not told apart (faster or slower only")


FIT = {"fixed_ms": 0.2, "scaled_layers": 36, "scaled_tok_s": 500.0, "pct_of_floor": 40.0, "floor_per_layer_us": 19.0}


def test_head_env_reaches_the_heads_runs_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # --head-env pins what the head runs (a decode variant, say): it is set for the head's bench
    # runs and named in its label, and the base's runs do not see it.
    seen: dict[str, dict[str, str]] = {}

    def fake_run(command: list[str], cwd: Path, env: dict[str, str], **kwargs: object) -> subprocess.CompletedProcess:
        seen[str(cwd)] = env
        return subprocess.CompletedProcess(command, 1, "", "stopped here")

    monkeypatch.setattr(cb.subprocess, "run", fake_run)
    monkeypatch.delenv("PREPKIT_DECODE_VARIANTS", raising=False)
    args = argparse.Namespace(tg=16, repetitions=1, step="kernels", device=None)
    head = cb.Build("head", "h", tmp_path / "head", (("PREPKIT_DECODE_VARIANTS", "k=n8-k8-w1-s1-p1"),))
    for build in (cb.Build("base", "b", tmp_path / "base"), head):
        with pytest.raises(SystemExit, match=f"{build.name} .* failed:\nstopped here"):
            cb.bench(build, tmp_path, 2, args)
    assert seen[str(tmp_path / "head")]["PREPKIT_DECODE_VARIANTS"] == "k=n8-k8-w1-s1-p1"
    assert "PREPKIT_DECODE_VARIANTS" not in seen[str(tmp_path / "base")]

    builds: list[cb.Build] = []
    monkeypatch.setattr(cb, "share_tactics", lambda *a: None)
    monkeypatch.setattr(cb, "compare", lambda b, *a: builds.extend(b) or ([], []))
    monkeypatch.setattr(cb, "summarize", lambda rounds: {})
    monkeypatch.setattr(cb, "table", lambda *a: "")
    monkeypatch.setattr(cb, "build_tree", lambda rev, dest: dest)
    assert cb.main(["f", "--base", "r1", "--head", "r1", "--head-env", "A=1=2", "--head-env", "B="]) == 0
    assert builds[1].env == (("A", "1=2"), ("B", "")) and builds[1].label == "r1 A=1=2 B=" and builds[0].env == ()
    with pytest.raises(SystemExit):
        cb.main(["f", "--base", "r1", "--head-env", "no-equals"])


@needs_git
def test_head_against_itself_end_to_end(tiny_prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "compare.json"
    code = cb.main([
        str(tiny_prepared), "--base", "HEAD", "--layers", "2,1", "--rounds", "1", "-r", "1", "--tg", "3",
        "--step", "modules", "--device", DEVICE, "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    assert "| base: HEAD |" in table and "| head: working tree |" in table and "head/base per layer" in table
    saved = json.loads(out.read_text())
    reports = saved["reports"][0]
    assert {r["model"]["layers"] for r in reports.values()} == {1, 2}
    assert reports["base L2"]["source"] != reports["head L2"]["source"]
    assert reports["base L2"]["tactics"] == reports["head L2"]["tactics"]

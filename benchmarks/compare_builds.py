"""The decode step of two builds of prepkit on one prepared folder, in one run, fitted per layer:

    python -m benchmarks.compare_builds FOLDER --base REV|DIR [--head REV|DIR] [--layers 4,2] [--rounds 2]
        [-r 3] [--step kernels] [--tg 128] [--own-tactics] [--head-env NAME=VALUE] [--out compare.json]

Each build runs ``prepkit bench FOLDER --pp '' --tg N --no-sampled`` at two layer counts, the
builds alternating inside every round (so drift between the first and the last minute falls on
both), and each round is fitted per layer and fixed part and scaled to the recipe's depth (36 layers
for gpt-oss-120b) by ``prepkit.generation.layer_fit``; the table gives the median over the rounds,
then each round's head/base ratios, and a verdict: the head is faster (slower) only where its tok/s
is above (below) the base's at both layer counts in every round, since the per-layer fit of one
build moves by several percent between runs.

``--head-env NAME=VALUE`` sets a variable for the head's runs alone: with ``--head`` the same as
``--base`` and ``PREPKIT_DECODE_VARIANTS=KEY=VARIANT``, it times one decode kernel's variant inside
the captured step against the build's own choice.

A build is a git revision, written out with ``git archive`` (the package, the benchmarks, the
recipes and the tactics DB); a folder holding such a tree (its ``prepkit/``), copied, for a
machine without the project's git history; or the working tree (``--head`` left out). The
tactics DB sits at the top of a checkout, beside the package: a tree made of the package alone
runs the built-in default tactics, and comparing it against a tuned build measures the tactics, not the change. So both
builds read the head's ``tactics.db`` unless ``--own-tactics``; and where the reports still name
different MoE tactics (a change of kernel version, a retune), the comparison stops with exit code
1 unless ``--allow-different-tactics``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prepkit.constants import RECIPES_FOLDER, TACTICS_DB_NAME  # noqa: E402
from prepkit.generation.layer_fit import fit_layers, tg_ms  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# What a build needs to run ``prepkit bench`` from its own tree; the tactics DB and the project
# file make the tree a checkout to ``prepkit.data`` (it finds the DB at the top).
TREE_PATHS = ("prepkit", "benchmarks", RECIPES_FOLDER, TACTICS_DB_NAME, "pyproject.toml")
FIT_KEYS = ("per_layer_us", "fixed_ms", "scaled_layers", "scaled_tok_s", "pct_of_floor", "floor_per_layer_us")


@dataclass(frozen=True)
class Build:
    name: str  # "base" or "head"
    label: str  # the revision as given, or "working tree"
    tree: Path
    env: tuple[tuple[str, str], ...] = ()  # variables set for this build's runs alone


def materialize(rev: str, dest: Path, repo: Path = REPO) -> Path:
    """The files of revision ``rev`` that a build runs from, written under ``dest``."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-tree", "--name-only", rev, *TREE_PATHS], capture_output=True, text=True
    )
    if listed.returncode != 0:
        raise SystemExit(f"compare_builds: git cannot read revision {rev!r}: {listed.stderr.strip()}")
    paths = listed.stdout.split()
    if "prepkit" not in paths:
        raise SystemExit(f"compare_builds: revision {rev!r} holds no prepkit package")
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", rev, *paths], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"compare_builds: git archive {rev}: {archive.stderr.decode().strip()}")
    with tempfile.TemporaryFile() as raw:
        raw.write(archive.stdout)
        raw.seek(0)
        with tarfile.open(fileobj=raw) as tar:
            tar.extractall(dest, filter="data")  # git's own archive; the filter refuses paths outside dest
    return dest


def build_tree(spec: str, dest: Path, repo: Path = REPO) -> Path:
    """The tree a build runs from: a copy of folder ``spec`` where it holds a ``prepkit``
    package, else revision ``spec`` written out (:func:`materialize`)."""
    folder = Path(spec)
    if not folder.is_dir():
        return materialize(spec, dest, repo)
    if not (folder / "prepkit" / "__init__.py").is_file():
        raise SystemExit(f"compare_builds: folder {spec} holds no prepkit package")
    dest.mkdir(parents=True, exist_ok=True)
    for name in TREE_PATHS:
        source = folder / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.is_file():
            shutil.copyfile(source, dest / name)
    return dest


def share_tactics(builds: list[Build], source: Path) -> None:
    """Give every build ``source`` as its bundled tactics DB (a copy in its tree)."""
    if not source.is_file():
        raise SystemExit(f"compare_builds: no tactics DB to share at {source} (--own-tactics runs each build's own)")
    for build in builds:
        target = build.tree / TACTICS_DB_NAME
        if target.resolve() != source.resolve():
            shutil.copyfile(source, target)


def bench(build: Build, folder: Path, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    """``prepkit bench``'s JSON report of ``build`` on ``folder``'s first ``layers`` layers."""
    command = [
        sys.executable, "-m", "prepkit", "bench", str(folder), "--pp", "", "--tg", str(args.tg), "--no-sampled",
        "-r", str(args.repetitions), "--step", args.step, "--layers", str(layers), "--json",
    ]  # fmt: skip
    if args.device:
        command += ["--device", args.device]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(build.tree), os.environ.get("PYTHONPATH")]))}
    env.update(build.env)
    done = subprocess.run(command, cwd=build.tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"compare_builds: {build.name} ({build.label}) at {layers} layers failed:\n{tail}")
    report = json.loads(done.stdout)
    report["source"] = str(build.tree)
    rate = tok_s(report, args.tg)
    print(f"{build.name} ({build.label}), {layers} layers: {rate:.1f} tok/s", file=sys.stderr, flush=True)
    return report


def tok_s(report: dict[str, Any], tg: int) -> float:
    """Decoded tokens a second of ``report``'s ``tg`` test (its median)."""
    return 1e3 / tg_ms(report, f"tg{tg}")


class TacticsDiffer(Exception):
    """The two builds ran different MoE tactics: their figures would compare those, not the change."""


def compare(
    builds: list[Build], counts: list[int], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``args.rounds`` rounds of both builds, the order flipped every round: each round's fits
    per build, and its reports."""
    rounds, reports = [], []
    for i in range(args.rounds):
        got = run_round(builds if i % 2 == 0 else builds[::-1], counts, args)
        clash = [line for n in counts for line in different_tactics(got[("base", n)], got[("head", n)])]
        if clash and not args.allow_different_tactics:
            raise TacticsDiffer(
                "the builds ran different MoE tactics, so the figures would compare those:\n  "
                + "\n  ".join(clash)
                + "\n(--allow-different-tactics to compare anyway)"
            )
        rounds.append({b.name: fit_round(got[(b.name, counts[0])], got[(b.name, counts[1])], args.tg) for b in builds})
        for b in builds:
            rounds[-1][b.name]["tok_s_at"] = {n: tok_s(got[(b.name, n)], args.tg) for n in counts}
        reports.append({f"{name} L{n}": report for (name, n), report in got.items()})
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return rounds, reports


def run_round(order: list[Build], counts: list[int], args: argparse.Namespace) -> dict[tuple[str, int], dict]:
    """Every build of ``order`` at every layer count, the builds alternating at each count."""
    return {(b.name, n): bench(b, args.folder, n, args) for n in counts for b in order}


def different_tactics(base: dict[str, Any], head: dict[str, Any]) -> list[str]:
    """The token counts at which the two reports' MoE tactics differ, each as a line."""
    a, b = base.get("tactics") or {}, head.get("tactics") or {}
    differ = [t for t in sorted(set(a) | set(b), key=str) if a.get(t) != b.get(t)]
    return [f"{t} tokens: base {a.get(t)!r}, head {b.get(t)!r}" for t in differ]


def fit_round(full: dict[str, Any], few: dict[str, Any], tg: int) -> dict[str, Any]:
    """One build's per-layer fit of one round (``tg``: the tg test's length)."""
    return fit_layers(full, few, test=f"tg{tg}")


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """The median of each fitted figure over the rounds, per build (``None`` for the floor's
    figures where the run measured no copy bandwidth)."""
    out: dict[str, dict[str, float | None]] = {}
    for name in rounds[0]:
        values = {key: [r[name][key] for r in rounds] for key in FIT_KEYS}
        out[name] = {key: None if None in v else statistics.median(v) for key, v in values.items()}
    return out


def round_lines(rounds: list[dict[str, dict[str, Any]]]) -> list[str]:
    """Each round's head/base ratios: the fitted time a layer, and tok/s at each layer count."""
    lines = []
    for i, r in enumerate(rounds, 1):
        base, head = r["base"], r["head"]
        counts = ", ".join(f"{n} layers {_ratio(head['tok_s_at'][n], base['tok_s_at'][n])}" for n in base["tok_s_at"])
        lines.append(
            f"round {i}: head/base per layer {_ratio(head['per_layer_us'], base['per_layer_us'])}; tok/s {counts}"
        )
    return lines


def verdict(rounds: list[dict[str, dict[str, Any]]]) -> str:
    """How the head stands against the base: "faster" ("slower") where its tok/s is above (below)
    the base's at both layer counts in every round, else "not told apart". A per-layer fit is the
    difference of two counts' times, so the drift of one count moves it by several percent between
    runs of one build (docs/decode.md): its ratio alone does not tell two builds apart."""
    signs = set()
    for r in rounds:
        base, head = r["base"]["tok_s_at"], r["head"]["tok_s_at"]
        signs |= {(head[n] > base[n]) - (head[n] < base[n]) for n in base}
    if signs == {1}:
        return "faster"
    if signs == {-1}:
        return "slower"
    return "not told apart"


def _figure(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def table(
    summary: dict[str, dict[str, float | None]], builds: list[Build], rounds: list[dict[str, dict[str, Any]]]
) -> str:
    lines = [
        f"| build | per layer (floor) | fixed | {summary['base']['scaled_layers']} layers | % of floor |",
        "|---|---:|---:|---:|---:|",
    ]
    for build in builds:
        s = summary[build.name]
        lines.append(
            f"| {build.name}: {build.label} | {_figure(s['per_layer_us'], '.1f')} us "
            f"({_figure(s['floor_per_layer_us'], '.1f')}) | {_figure(s['fixed_ms'], '.3f')} ms | "
            f"{_figure(s['scaled_tok_s'], '.1f')} tok/s | {_figure(s['pct_of_floor'], '.1f')} |"
        )
    base, head = summary["base"], summary["head"]
    lines.append("")
    lines.append(
        f"head/base per layer: {_ratio(head['per_layer_us'], base['per_layer_us'])}; "
        f"tok/s at {summary['base']['scaled_layers']} layers: {_ratio(head['scaled_tok_s'], base['scaled_tok_s'])}"
    )
    lines += round_lines(rounds)
    lines.append(f"head against base: {verdict(rounds)} (faster or slower only at both layer counts in every round)")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a prepared folder")
    parser.add_argument("--base", required=True, help="the git revision (or build folder) to compare against")
    parser.add_argument("--head", help="a git revision or build folder (default: the working tree)")
    parser.add_argument("--layers", default="4,2", help="the two layer counts to fit over (default 4,2)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both builds at both counts (default 2)")
    parser.add_argument("-r", "--repetitions", type=int, default=3, help="prepkit bench's -r (default 3)")
    parser.add_argument("--tg", type=int, default=128, help="decoded tokens a test (default 128)")
    parser.add_argument("--step", default="kernels", help="prepkit bench's --step (default kernels)")
    parser.add_argument("--device", help="prepkit bench's --device")
    parser.add_argument("--own-tactics", action="store_true", help="each build reads its own tactics.db")
    parser.add_argument("--allow-different-tactics", action="store_true", help="compare even so")
    parser.add_argument(
        "--head-env", action="append", default=[], metavar="NAME=VALUE",
        help="an environment variable for the head's runs alone, e.g. PREPKIT_DECODE_VARIANTS=KEY=VARIANT",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="write every report and fit here (JSON)")
    args = parser.parse_args(argv)
    head_env = []
    for item in args.head_env:
        name, sep, value = item.partition("=")
        if not (sep and name):
            parser.error(f"--head-env takes NAME=VALUE, not {item!r}")
        head_env.append((name, value))
    try:
        counts = [int(v) for v in args.layers.split(",")]
    except ValueError:
        counts = []
    if len(counts) != 2 or counts[0] <= counts[1] or counts[1] < 1:
        parser.error(f"--layers takes two counts, the larger first, not {args.layers!r}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="compare-builds-") as scratch:
        base = Build("base", args.base, build_tree(args.base, Path(scratch) / "base"))
        head_label = (args.head or "working tree") + "".join(f" {n}={v}" for n, v in head_env)
        head_tree = build_tree(args.head, Path(scratch) / "head") if args.head else REPO
        head = Build("head", head_label, head_tree, tuple(head_env))
        builds = [base, head]
        if not args.own_tactics:
            share_tactics(builds, head.tree / TACTICS_DB_NAME)
        try:
            rounds, reports = compare(builds, counts, args)
        except TacticsDiffer as clash:
            print(f"compare_builds: {clash}", file=sys.stderr)
            return 1
    summary = summarize(rounds)
    print(table(summary, builds, rounds))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rounds": rounds, "reports": reports}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Batch-1 decode of one checkpoint on one GPU and split over several, in one run, each split with
each sum asked for:

    python -m benchmarks.bench_splits --workdir DIR [--splits tp2,ep2,tp4] [--sums default,symmetric,nccl]
        [--layers 4,2] [-r 3] [--tg 128] [--out F] [--tiny --device cpu]

The checkpoint is ``prepkit synth``'s random weights at gpt-oss-120b's dims (128 experts, H = I =
2880, 64/8 heads, the 201,088-token vocabulary) with ``--layers``' larger count of layers, prepared
with ``--layout triton-moe`` once per split (kept in ``--workdir`` for a later run). Each figure is
``prepkit bench FOLDER --pp '' --tg N --no-sampled --step kernels --layers A,B [--nproc N]``: tg
at batch 1, fitted over the two layer counts and scaled to the recipe's depth (36 layers), with
the copy bandwidth measured in the same run. ``--sums`` sets ``PREPKIT_ALL_REDUCE`` for the split
runs (``default``: unset). A split that needs more GPUs than the host has is left out.

Prints one markdown table (rank 0's figures; ``vs TP 1`` is the scaled tok/s over TP 1's) and
writes every report to ``--out``. ``--tiny --device cpu`` runs the same on tiny dims on the
Triton interpreter, over gloo: a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_generate import log, write_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = {"num_experts": 4, "hidden": 64, "intermediate": 64, "top_k": 2, "vocab_size": 256}
SPLIT = re.compile(r"^(tp|ep)(\d+)$")


def parse_split(name: str) -> tuple[int, int]:
    """``tp2`` -> (2, 1), ``ep4`` -> (1, 4)."""
    match = SPLIT.match(name)
    if match is None or int(match[2]) < 1:
        raise argparse.ArgumentTypeError(f"{name!r}: a split is tpN or epN")
    n = int(match[2])
    return (n, 1) if match[1] == "tp" else (1, n)


def prepared(src: Path, out: Path, tp: int, ep: int) -> Path:
    if not (out / "manifest.json").is_file():
        argv = ["prepare", "--src", str(src), "--out", str(out), "--layout", "triton-moe", "-q"]
        run_prepkit([*argv, "--tp", str(tp), "--ep", str(ep)], {})
    return out


def run_prepkit(argv: list[str], env: dict[str, str]) -> str:
    """``prepkit ARGV`` in a process of its own (a split run starts its ranks); its stdout."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "prepkit", *argv]
    done = subprocess.run(
        command, env={**os.environ, **env, "PYTHONPATH": path}, cwd=REPO, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"prepkit {' '.join(argv)}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return done.stdout


def bench(folder: Path, ranks: int, sum_kind: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = ["bench", str(folder), "--pp", "", "--tg", str(args.tg), "--no-sampled", "-r", str(args.repetitions)]
    argv += ["--layers", args.layers, "--device", args.device, "--json", "-q"]
    if args.device != "cpu":
        argv += ["--step", "kernels"]
    if ranks > 1:
        argv += ["--nproc", str(ranks)]
    env = {"PREPKIT_ALL_REDUCE": "" if sum_kind == "default" else sum_kind}
    report: dict[str, Any] = json.loads(run_prepkit(argv, env))
    return report


def split_label(tp: int, ep: int) -> str:
    return "TP 1" if tp == ep == 1 else f"TP {tp}" if ep == 1 else f"EP {ep}"


def row(label: str, sum_kind: str, report: dict[str, Any], base_tok_s: float | None) -> str:
    fit = report["fit"]
    transport = (report.get("ranks") or {}).get("all_reduce")
    sum_cell = f"{sum_kind} ({transport})" if transport else "-"
    vs = f"{fit['scaled_tok_s'] / base_tok_s:.2f}x" if base_tok_s else "-"
    kernels = fit.get("kernels_per_layer")
    cells = [
        label, sum_cell, f"{fit['per_layer_us']:.1f} us", f"{fit['fixed_ms']:.3f} ms",
        f"{fit['scaled_tok_s']:.1f}", vs, f"{kernels:g}" if kernels is not None else "-",
        f"{report.get('peak_memory_gib') or 0:.2f} GiB",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="checkpoint and prepared sets (kept)")
    parser.add_argument("--splits", default="tp2,ep2", help="splits besides TP 1, comma-separated (tpN, epN)")
    parser.add_argument("--sums", default="default", help="PREPKIT_ALL_REDUCE values for the splits (default: unset)")
    parser.add_argument("--layers", default="4,2", help="the two layer counts to fit over (default 4,2)")
    parser.add_argument("-r", "--repetitions", type=int, default=3)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu with --tiny")
    parser.add_argument("--tiny", action="store_true", help="tiny dims: a smoke test of the script")
    parser.add_argument("--out", type=Path, help="write every report here (JSON)")
    args = parser.parse_args(argv)
    splits = {name: parse_split(name) for name in filter(None, args.splits.split(","))}
    sums = [s for s in args.sums.split(",") if s]
    counts = sorted({int(n) for n in args.layers.split(",")}, reverse=True)
    if len(counts) != 2:
        parser.error(f"--layers {args.layers}: two different layer counts")
    gpus = 0
    if args.device != "cpu":
        import torch

        gpus = torch.cuda.device_count()
    log(f"checkpoint: {counts[0]} layers{' (tiny dims)' if args.tiny else ''}")
    src = write_checkpoint(args.workdir / ("tiny" if args.tiny else "src"), counts[0], 0, TINY if args.tiny else None)
    reports: dict[str, Any] = {}
    log("bench tp1")
    base = bench(prepared(src, args.workdir / "tp1", 1, 1), 1, "default", args)
    reports["tp1"] = base
    lines = [
        "| split | sum (used) | per layer | fixed | tok/s at depth | vs TP 1 | kernels a layer | peak memory, rank 0 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        row("TP 1", "-", base, None),
    ]
    base_tok_s = base["fit"]["scaled_tok_s"]
    for name, (tp, ep) in splits.items():
        ranks = tp * ep
        if args.device != "cpu" and ranks > gpus:
            log(f"{name}: needs {ranks} GPUs, this host has {gpus}: left out")
            continue
        folder = prepared(src, args.workdir / name, tp, ep)
        for sum_kind in sums:
            log(f"bench {name}, sum {sum_kind}")
            report = bench(folder, ranks, sum_kind, args)
            reports[f"{name}-{sum_kind}"] = report
            lines.append(row(split_label(tp, ep), sum_kind, report, base_tok_s))
    device = base.get("device", args.device)
    depth = base["fit"]["scaled_layers"]
    print(f"batch-1 decode (tg{args.tg}) on {device}, fitted over {counts} layers, scaled to {depth}")
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text(json.dumps(reports, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

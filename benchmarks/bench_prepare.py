"""Throughput and memory of ``prepkit prepare`` against a plain copy of the same bytes.

Writes a synthetic gpt-oss checkpoint (real 120b expert dims, 128 experts, enough layers for at
least 4 GB), then times, each in a fresh process on the same disk, in interleaved rounds:
  * ``cp`` of the source shard files followed by ``sync`` (the plain copy; GNU cp copies inside
    the kernel where it can, never touching user memory);
  * ``dd bs=64M`` of the same files followed by ``sync`` (the bytes through user space once);
  * ``prepkit prepare --tp 1`` and ``--tp 8`` (trtllm-gen), which also fsync every file.
Reports source GB/s, the ratio to the copy, and each process's peak RSS against two layers.

    python benchmarks/bench_prepare.py [--layers 3] [--workdir .bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYER_BYTES_120B = 1_748_118_784  # expert bytes of one gpt-oss-120b layer


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return elapsed, usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path(".bench"))
    args = ap.parse_args()

    work = args.workdir
    src = work / "src"
    if not (src / "config.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        print(f"writing a synthetic checkpoint: {args.layers} layers x {args.experts} experts ...", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "prepkit",
                "synth",
                str(src),
                "--layers",
                str(args.layers),
                "--experts",
                str(args.experts),
                "--vocab",
                "8192",
                "-q",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    shards = sorted(src.glob("model-*.safetensors"))
    source_bytes = sum(p.stat().st_size for p in shards)
    layer_bytes = LAYER_BYTES_120B * args.experts // 128
    # warm the page cache once so every contender reads the same way
    for p in shards:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass

    # Rounds interleave the contenders, so a drift in the (shared, virtual) disk's speed hits
    # all of them alike; medians over rounds.
    times: dict[str, list[float]] = {"copy": [], "dd": [], "tp1": [], "tp8": []}
    peaks: dict[str, list[int]] = {"tp1": [], "tp8": []}
    for _ in range(args.repeats):
        dst = work / "copy"
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        t, _ = timed(["sh", "-c", f"cp {' '.join(str(p) for p in shards)} {dst}/ && sync"])
        times["copy"].append(t)
        shutil.rmtree(dst, ignore_errors=True)
        # the same bytes through user space (read into memory, write out), as any transform must
        dst.mkdir(parents=True)
        dd = " && ".join(f"dd if={p} of={dst / p.name} bs=64M status=none" for p in shards)
        t, _ = timed(["sh", "-c", f"{dd} && sync"])
        times["dd"].append(t)
        shutil.rmtree(dst, ignore_errors=True)
        for tp in (1, 8):
            out = work / f"tp{tp}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [
                sys.executable,
                "-m",
                "prepkit",
                "prepare",
                "--src",
                str(src),
                "--tp",
                str(tp),
                "--out",
                str(out),
                "-q",
            ]
            t, rss = timed(cmd)
            times[f"tp{tp}"].append(t)
            peaks[f"tp{tp}"].append(rss)
            shutil.rmtree(out, ignore_errors=True)
    copy_t = statistics.median(times["copy"])
    dd_t = statistics.median(times["dd"])
    rows = [
        ("cp + sync", copy_t, source_bytes / copy_t / 1e9, 1.0, None),
        ("dd bs=64M + sync", dd_t, source_bytes / dd_t / 1e9, copy_t / dd_t, None),
    ]
    for tp in (1, 8):
        t = statistics.median(times[f"tp{tp}"])
        rows.append((f"prepare --tp {tp}", t, source_bytes / t / 1e9, copy_t / t, max(peaks[f"tp{tp}"])))
    shutil.rmtree(work / "copy", ignore_errors=True)

    print(
        f"\nsource: {source_bytes / 1e9:.2f} GB in {len(shards)} shards; one layer = {layer_bytes / 1e9:.2f} GB; "
        f"{os.cpu_count()} CPUs; median of {args.repeats}"
    )
    print(f"{'run':<18}{'seconds':>9}{'GB/s':>8}{'x copy':>8}{'peak RSS':>11}{'/ 2 layers':>12}")
    for name, t, gbps, ratio, rss in rows:
        rss_s = f"{rss / 1e9:.2f} GB" if rss else "-"
        frac = f"{rss / (2 * layer_bytes):.2f}" if rss else "-"
        print(f"{name:<18}{t:>9.2f}{gbps:>8.2f}{ratio:>8.2f}{rss_s:>11}{frac:>12}")


if __name__ == "__main__":
    main()

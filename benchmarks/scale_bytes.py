"""Which E8M0 scale bytes a gpt-oss checkpoint holds, and so whether the kernel's folded upcast
(every scale byte of a GEMM <= 128) applies to its expert GEMMs.

Reads each shard's safetensors header and then only its ``*_scales`` tensors: from a local folder
or file, or from a hub repo by HTTP range requests: about 100 MB of scales per gpt-oss-120b layer,
a few hundred MB a shard, 3.6 GB for all 36 layers, against the 65 GB checkpoint. One shard by
default (the first that holds expert scales), ``--all`` for every shard. The table and the verdict
go to stdout, progress to stderr; ``--json`` prints the per-tensor histograms instead.

    python -m benchmarks.scale_bytes                       # openai/gpt-oss-120b at the recipe's commit
    python -m benchmarks.scale_bytes openai/gpt-oss-20b --all
    python -m benchmarks.scale_bytes path/to/checkpoint --json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from prepkit import console
from prepkit.errors import CheckpointError, PrepkitError
from prepkit.fsutil import format_bytes
from prepkit.scale_stats import SMALL_SCALE_MAX, ScaleStats, ShardSet, folded_everywhere, hub_shards, local_shards
from prepkit.scale_stats import scale_stats as read_scale_stats

DEFAULT_SOURCE = "openai/gpt-oss-120b"
VERDICT = "folded upcast applies to every expert GEMM"


def open_source(source: str, revision: str | None, endpoint: str | None) -> ShardSet:
    """A local folder or file if ``source`` is one, else a hub repo id or recipe name (a recipe's
    repo is read at the recipe's pinned commit unless ``revision`` says otherwise)."""
    if Path(source).exists():
        return local_shards(source)
    from prepkit.fetch.source import resolve_source

    resolved = resolve_source(source, revision=revision)
    return hub_shards(resolved.repo_id, resolved.revision, endpoint=endpoint)


def table(stats: list[ScaleStats]) -> str:
    head = ("file", "tensor", "gemm", "bytes", "min", "max", f">{SMALL_SCALE_MAX}", "small")
    rows = [
        (
            s.file,
            s.tensor,
            s.gemm or "-",
            str(s.count),
            str(s.min),
            str(s.max),
            str(s.above),
            "yes" if s.small else "no",
        )
        for s in stats
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    right = {3, 4, 5, 6}
    return "\n".join(
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in [head, *rows]
    )


def histogram(stats: list[ScaleStats]) -> list[tuple[int, int]]:
    """(byte, count) over every tensor read, the bytes that occur."""
    totals = [sum(s.histogram[b] for s in stats) for b in range(256)]
    return [(b, n) for b, n in enumerate(totals) if n]


def report(shards: ShardSet, read: list[str], stats: list[ScaleStats], read_bytes: int) -> dict[str, Any]:
    return {
        "source": shards.where,
        "shards": len(shards.shards),
        "shards_read": read,
        "bytes_read": read_bytes,
        "tensors": [s.to_json() for s in stats],
        "histogram": {str(b): n for b, n in histogram(stats)},
        "folded_upcast_every_expert_gemm": folded_everywhere(stats),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "source",
        nargs="?",
        default=DEFAULT_SOURCE,
        help=f"a checkpoint folder, a .safetensors file, a hub repo id or a recipe name (default {DEFAULT_SOURCE})",
    )
    parser.add_argument("--revision", help="hub branch, tag or commit (default: the recipe's pinned commit, else main)")
    parser.add_argument("--endpoint", default=os.environ.get("HF_ENDPOINT"), help="hub URL (default $HF_ENDPOINT)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", dest="every", action="store_true", help="read every shard")
    which.add_argument("--shard", action="append", default=[], help="read this shard (repeatable)")
    parser.add_argument("--json", dest="as_json", action="store_true", help="print a JSON report on stdout")
    args = parser.parse_args(argv)
    console.set_json(args.as_json)

    def tell(tensor: str, nbytes: int) -> None:
        console.info(f"  {tensor}: {format_bytes(nbytes)}")

    try:
        shards = open_source(args.source, args.revision, args.endpoint)
        names = shards.pick(args.shard, every=args.every)
        stats: list[ScaleStats] = []
        read_bytes = 0
        for name in names:
            console.info(f"{shards.where}: reading the scales of {name}")
            found = read_scale_stats(shards.open(name), on_tensor=tell)
            read_bytes += sum(s.count for s in found)
            stats += found
        if not any(s.gemm for s in stats):
            raise CheckpointError(
                f"{shards.where}: no expert scales (gate_up_proj_scales, down_proj_scales) in {', '.join(names)}",
                hint="name a shard that holds expert layers with --shard, or read them all with --all",
            )
    except PrepkitError as err:
        if console.json_requested():
            console.emit_json({"error": str(err), "hint": err.hint, "exit_code": err.exit_code})
        else:
            console.error(str(err), err.hint, debug_note=False)
        return err.exit_code
    if args.as_json:
        console.emit_json(report(shards, names, stats, read_bytes))
        return 0
    total = max(1, sum(s.count for s in stats))
    width = len(str(total))
    out = [table(stats), "", f"byte  scale   {'count':>{width}}  share"]
    out += [f"{b:>4}  2^{b - 127:<5} {n:>{width}}  {100 * n / total:5.1f} %" for b, n in histogram(stats)]
    out += ["", f"{VERDICT}: {'yes' if folded_everywhere(stats) else 'no'}"]
    scope = (
        f"read {len(names)} of {len(shards.shards)} shard(s) of {shards.where}: {format_bytes(read_bytes)} of scales"
    )
    out.append(scope + ("" if args.every or len(names) == len(shards.shards) else "; --all reads every shard"))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

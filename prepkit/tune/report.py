"""What a tune or a tactics DB shows people: the run summary, the bandwidth floor, the plot.

No rich or click here: the CLI renders these records; matplotlib is imported only to plot.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prepkit.distribution import install_hint
from prepkit.errors import DependencyError
from prepkit.tactics.keys import DENSE_ROLE, DENSE_W_DTYPES
from prepkit.tune.run import TuneReport

# Tile knobs in launch order and their short names (``m16 n64 k256 w4 s3 sk1``).
_TILE_KNOBS = {"block_m": "m", "block_n": "n", "block_k": "k", "num_warps": "w", "num_stages": "s", "split_k": "sk"}


def summary(report: TuneReport) -> dict[str, Any]:
    """The run as plain data: what ``prepkit tune --json`` prints and the table is made from. A
    thorough search adds each GEMM's ``coverage`` (:class:`~prepkit.tune.records.Coverage`); a
    dense problem its ``name`` ("dense mxfp4 qkv 5120x2880")."""
    layer = report.layer
    thorough = report.search == "thorough"
    return {
        "db": str(report.db_path),
        "device": report.env.name,
        "arch": report.env.arch,
        "status": report.status,
        "search": report.search,
        "elapsed_s": round(layer.elapsed_s, 1),
        "layer_geomean_speedup": layer.layer_geomean(),
        "problems": [
            {
                **({"coverage": r.coverage.record()} if thorough and r.coverage else {}),
                "problem": r.problem.describe(),
                **({"name": r.label} if r.label else {}),
                "complete": r.complete,
                "elapsed_s": round(r.elapsed_s, 1),
                "timed": r.n_timed,
                "retimed": r.n_retimed,
                "reused": r.n_reused,
                "blocklisted": len(r.blocked),
                "geomean_speedup": r.geomean_speedup(),
                "ranges": len(r.winners),
                "notes": r.notes,
                "points": [
                    {
                        "m": c.m,
                        "default_us": c.default_us,
                        "tuned_us": c.winner_us,
                        "speedup": c.speedup,
                        "why": c.why,
                        "retimed": c.retimed,
                    }
                    for c in r.choices
                ],
            }
            for r in layer.results
        ],
        "layer": [asdict(p) | {"speedup": p.speedup} for p in layer.layer_points],
        **({"decode": [r.record() for r in report.decode]} if report.decode else {}),
        **({"decode_notes": list(report.decode_notes)} if report.decode_notes else {}),
    }


def decode_line(d: dict[str, Any]) -> str:
    """``decode o linear_residual bf16 2880x4096 b1: n64-k128-w4-s1-p1 3.1 us, 1.21x vs default
    (retimed in 3 rounds)`` (a :meth:`~prepkit.tune.decode_sweep.DecodeResult.record`)."""
    if d["winner"] is None:
        return f"{d['name']}: no variant passed ({d['failed']} failed)"
    gain = f", {d['speedup']:.2f}x vs default" if d.get("speedup") else ""
    rounds = f" (retimed in {d['retimed']} rounds)" if d.get("retimed") else ""
    partial = "" if d["complete"] else " (partial: budget reached, not stored)"
    return f"{d['name']}: {d['winner']} {d['winner_us']:.1f} us{gain}{rounds}, {d['failed']} failed{partial}"


def coverage_line(cov: dict[str, Any]) -> str:
    """``  thorough search, bf16: 3384 valid variants, 3384 checked, 12 failed, 3372 measured at
    1, 4, 16, 128, 1024, 4096 tokens`` (a :meth:`Coverage.record`, with the policy)."""
    valid = f"{cov['valid']} valid variants, " if cov.get("valid") is not None else ""
    took = "" if cov.get("valid") == cov["candidates"] else f"{cov['candidates']} taken up, "
    anchors = cov.get("anchors") or []
    at = f" at {', '.join(map(str, anchors))} tokens" if anchors else ""
    return (
        f"  {cov['search']} search, {cov['activations']}: {valid}{took}{cov['checked']} checked, "
        f"{cov['failed']} failed, {cov['measured']} measured{at}"
    )


def short_tactic(params_json: str) -> str:
    """``m16 n64 k256 w4 s3 sk1 upcast=asm weight_load=tma``: the tile first, in launch order, then
    the other knobs by name (any knob a kernel stores, known here or not)."""
    d = json.loads(params_json)
    tile = [f"{short}{d[name]}" for name, short in _TILE_KNOBS.items() if name in d]
    rest = [f"{k}={v}" for k, v in sorted(d.items()) if k not in _TILE_KNOBS]
    return " ".join(tile + rest)


def winner_groups(winners: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Winner rows grouped per (environment, problem), in the DB's order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for w in winners:
        groups.setdefault((w["env_hash"], w["problem_hash"]), []).append(w)
    return list(groups.values())


def floor_us(w: dict[str, Any], m: int, gbps: float, scope: str = "gemm") -> float:
    """Least time a call can take at ``m`` tokens when it only moves bytes: the touched experts'
    MXFP4 weights, scales and fp32 biases (uniform routing touches E*(1-(1-1/E)^(m*top_k))
    experts) plus activations in and out; of the swept GEMM (``scope='gemm'``) or of the layer.
    A dense linear moves its whole MX weight and scales, the bf16 rows in and out."""
    if w["role"] == DENSE_ROLE:
        per_value = 1.0 if w.get("w_dtype") == DENSE_W_DTYPES["mxfp8"] else 0.5
        return (w["n"] * w["k"] * (per_value + 1 / 32) + m * (w["k"] + w["n"]) * 2) / (gbps * 1e3)
    E, top_k = w["num_experts"], w["top_k"]
    H, I = (w["k"], w["n"] // 2) if w["role"] == "gemm1" else (w["n"], w["k"])
    touched = E * (1.0 - (1.0 - 1.0 / E) ** (m * top_k))
    gemm1 = touched * (2 * I * H * (1 / 2 + 1 / 32) + 2 * I * 4) + m * H * 2 + m * top_k * I * 2
    gemm2 = touched * (H * I * (1 / 2 + 1 / 32) + H * 4) + m * top_k * I * 2 + m * H * 4
    own = gemm1 if w["role"] == "gemm1" else gemm2
    return (gemm1 + gemm2 if scope == "layer" else own) / (gbps * 1e3)


def plot_panels(tdb: Any, gpu: str | None) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """One panel per (environment, problem) with measurements: its first winner row (with the
    run's timing scope) and the default-vs-tuned curve."""
    panels = []
    for rows in winner_groups(tdb.winners()):
        w = rows[0]
        if gpu is not None and w["gpu_name"] != gpu:
            continue
        curve = tdb.curves(w["env_hash"], w["problem_hash"])
        if curve:
            panels.append(({**w, "scope": tdb.timing_scope(w["run_id"])}, curve))
    return panels


def plot(panels: list[tuple[dict[str, Any], list[dict[str, Any]]]], out: Path) -> None:
    """Latency per token count, tuned vs default, against the bandwidth floor, as a PNG.

    Raises:
        DependencyError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError as err:
        raise DependencyError("plotting needs matplotlib, which is not installed", hint=install_hint("plot")) from err

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (w, curve) in zip(axes[0], panels, strict=True):
        ms = [c["m"] for c in curve]
        ax.plot(ms, [c["default_us"] for c in curve], "o-", label="default variant", color="tab:gray")
        ax.plot(ms, [c["tuned_us"] for c in curve], "o-", label="tuned", color="tab:blue")
        if w.get("mem_bw_gbps"):
            ax.plot(ms, [floor_us(w, m, w["mem_bw_gbps"], w["scope"]) for m in ms], "--", color="tab:red",
                    label=f"bandwidth floor ({w['mem_bw_gbps']:.0f} GB/s copy)")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per call")
        what = "whole layer" if w["scope"] == "layer" else f"{w['role']} alone"
        ax.set_ylabel(f"latency of the {what}, median us")
        title = (
            f"{w['gpu_name']} ({w['arch']}, Triton {w['triton_version']})\n"
            f"{w['role']} swept: N={w['n']} K={w['k']} E={w['num_experts']} top_k={w['top_k']}"
        )
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)

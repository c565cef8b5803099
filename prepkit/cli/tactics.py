"""``prepkit tactics show | export | merge | plot``: read, share and combine tactic DBs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from prepkit import console
from prepkit import tactics_db as tdb_mod
from prepkit.cli._app import cli
from prepkit.cli._options import json_option
from prepkit.errors import TacticsError
from prepkit.runtime.tactics import bundled_db_path, user_db_path


def _db_option(f: Any) -> Any:
    return click.option(
        "--db",
        "db_path",
        type=click.Path(path_type=Path, dir_okay=False),
        help="Tactics DB (default: the user DB, else the bundled one).",
    )(f)


def _resolve(db_path: Path | None) -> Path:
    if db_path is not None:
        return db_path
    user = user_db_path()
    if user.is_file():
        return user
    bundled = bundled_db_path()
    if bundled is None:
        raise TacticsError("no tactics DB found", hint="run `prepkit tune`, or pass --db")
    return bundled


def _open_existing(path: Path) -> Any:
    """Read-only: showing, exporting or plotting never changes the file (a shipped DB stays as is)."""
    return tdb_mod.open_db_readonly(path)


@cli.group("tactics")
def tactics_group() -> None:
    """Inspect, export, merge and plot tactic databases (tactics.db)."""


@tactics_group.command("show")
@_db_option
@json_option
def show_command(db_path: Path | None, as_json: bool) -> None:
    """List the winner ranges per GPU and problem, with row counts.

    \b
    Example:
        prepkit tactics show --db tactics.db
    """
    path = _resolve(db_path)
    with _open_existing(path) as tdb:
        counts, winners = tdb.counts(), tdb.winners()
    if as_json:
        console.emit_json({"db": str(path), "counts": counts, "winners": winners})
        return
    from rich.table import Table

    console.info(f"{path}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for w in winners:
        groups.setdefault((w["env_hash"], w["problem_hash"]), []).append(w)
    for rows in groups.values():
        w0 = rows[0]
        t = Table(
            title=f"{w0['gpu_name']} ({w0['arch']}, Triton {w0['triton_version']}): {w0['role']} "
            f"N={w0['n']} K={w0['k']} E={w0['num_experts']} top_k={w0['top_k']} tp={w0['tp_size']}, "
            f"{w0['kernel']} v{w0['kernel_version']} {w0['weight_layout']}",
            title_justify="left",
        )
        t.add_column("tokens", justify="right", no_wrap=True)
        t.add_column("tactic", no_wrap=True)
        t.add_column("us", justify="right")
        t.add_column("vs default", justify="right")
        for w in rows:
            hi = "up" if w["extends_up"] else str(w["m_hi"])
            sp = w["speedup_vs_default"]
            t.add_row(
                f"{w['m_lo']}-{hi}", _short(w["params_json"]),
                f"{w['median_us']:.1f}" if w["median_us"] else "-", f"{sp:.2f}x" if sp else "-",
            )  # fmt: skip
        console.err_console.print(t)


_TILE_KNOBS = {"block_m": "m", "block_n": "n", "block_k": "k", "num_warps": "w", "num_stages": "s", "split_k": "sk"}


def _short(params_json: str) -> str:
    """``m16 n64 k256 w4 s3 sk1 upcast=asm weight_load=tma``: the tile first, in launch order, then
    the other knobs by name (any knob a kernel stores, known here or not)."""
    d = json.loads(params_json)
    tile = [f"{short}{d[name]}" for name, short in _TILE_KNOBS.items() if name in d]
    rest = [f"{k}={v}" for k, v in sorted(d.items()) if k not in _TILE_KNOBS]
    return " ".join(tile + rest)


@tactics_group.command("export")
@_db_option
@click.option("--json", "as_json", is_flag=True, required=True, help="Write every table as JSON on stdout.")
def export_command(db_path: Path | None, as_json: bool) -> None:
    """Dump the whole DB as JSON (for review, or to share measurements).

    \b
    Example:
        prepkit tactics export --json --db tactics.db > tactics.json
    """
    with _open_existing(_resolve(db_path)) as tdb:
        console.emit_json(tdb.export())


@tactics_group.command("merge")
@click.argument("dest", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("src", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@json_option
def merge_command(dest: Path, src: Path, as_json: bool) -> None:
    """Merge the rows of SRC into DEST (created if missing); SRC is only read.

    Measurements, checks and blocklist entries are unions; for each GPU and problem the winner
    ranges of the newer run win as a whole.

    \b
    Example:
        prepkit tactics merge ~/.cache/prepkit/tactics.db gpu1.db
    """
    with tdb_mod.open_db(dest) as tdb:
        added = tdb.merge_from(src)
    if as_json:
        console.emit_json({"db": str(dest), "added": added})
        return
    console.info(f"merged {src} into {dest}: " + ", ".join(f"+{v} {k}" for k, v in added.items()))
    click.echo(str(dest))


@tactics_group.command("plot")
@click.argument("out", type=click.Path(path_type=Path, dir_okay=False))
@_db_option
@click.option("--gpu", help="Only this GPU name (default: every GPU in the DB).")
def plot_command(out: Path, db_path: Path | None, gpu: str | None) -> None:
    """Plot latency per token count, tuned vs default, against the memory-bandwidth floor.

    \b
    Example:
        prepkit tactics plot tactics.png --db tactics.db
    """
    with _open_existing(_resolve(db_path)) as tdb:
        panels = [
            ({**w, "scope": tdb.timing_scope(w["run_id"])}, tdb.curves(w["env_hash"], w["problem_hash"]))
            for w in _panels(tdb.winners(), gpu)
        ]
    panels = [(w, c) for w, c in panels if c]
    if not panels:
        raise TacticsError(
            "nothing to plot: no winners with measurements" + (f" for GPU {gpu!r}" if gpu else ""),
            hint="run `prepkit tune` first, or check `prepkit tactics show`",
        )
    _plot(panels, out)
    click.echo(str(out))


def _panels(winners: list[dict[str, Any]], gpu: str | None) -> list[dict[str, Any]]:
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for w in winners:
        if gpu is None or w["gpu_name"] == gpu:
            seen.setdefault((w["env_hash"], w["problem_hash"]), w)
    return list(seen.values())


def floor_us(w: dict[str, Any], m: int, gbps: float, scope: str = "gemm") -> float:
    """Least time a call can take at ``m`` tokens when it only moves bytes: the touched experts'
    MXFP4 weights, scales and fp32 biases (uniform routing touches E*(1-(1-1/E)^(m*top_k))
    experts) plus activations in and out; of the swept GEMM (``scope='gemm'``) or of the layer."""
    E, top_k = w["num_experts"], w["top_k"]
    H, I = (w["k"], w["n"] // 2) if w["role"] == "gemm1" else (w["n"], w["k"])
    touched = E * (1.0 - (1.0 - 1.0 / E) ** (m * top_k))
    gemm1 = touched * (2 * I * H * (1 / 2 + 1 / 32) + 2 * I * 4) + m * H * 2 + m * top_k * I * 2
    gemm2 = touched * (H * I * (1 / 2 + 1 / 32) + H * 4) + m * top_k * I * 2 + m * H * 4
    own = gemm1 if w["role"] == "gemm1" else gemm2
    return (gemm1 + gemm2 if scope == "layer" else own) / (gbps * 1e3)


def _plot(panels: list[tuple[dict[str, Any], list[dict[str, Any]]]], out: Path) -> None:
    import matplotlib

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

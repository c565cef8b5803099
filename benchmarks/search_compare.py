"""How far the pruned search lands from the thorough one, read from the tuning runs a DB keeps.

Per GEMM and token count: the default's median, what each search picked and its median, the miss
(how much slower the pruned pick is than the thorough pick), and how long each search took.
``benchmarks/tune_compare.py`` prints it as a markdown table or JSON.

A run's winner ranges are replaced by the next run's, so the comparison reads the record each run
keeps of its sweeps in ``tuning_run.notes`` (:meth:`prepkit.tune.records.SweepResult.record`). A
search cut short by its budget or a kill and then resumed is several runs ("legs"): its time is the
sum of theirs, and its picks are those of the last leg that recorded them. A search whose runs
reused another search's timings (both in one DB) took less time than it would alone; for honest
durations give each search its own DB.

The miss compares like with like where it can: when the thorough search had a timing of the pruned
pick at that token count, both times are those the thorough search compared (``thorough
timings``); otherwise each pick is taken relative to the default timed in its own run (``vs
default``), so that drift between the runs cancels.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from prepkit.errors import TacticsError
from prepkit.fsutil import format_duration
from prepkit.tactics import store
from prepkit.tactics.keys import ProblemKey
from prepkit.tactics.schema import LEGACY_SEARCH
from prepkit.tune.backend import Backend
from prepkit.tune.records import CandidateError
from prepkit.tune.report import short_tactic


@dataclass
class SearchLegs:
    """The runs of one search on one GPU in one DB, oldest first; the last holds the records."""

    search: str
    db: str
    gpu_name: str
    env_hash: str
    runs: list[dict[str, Any]]
    records: dict[str, dict[str, Any]]  # problem hash -> the last leg's sweep record
    elapsed_s: dict[str, float]  # problem hash -> seconds its sweeps took over every leg
    # (problem hash, m, tactic JSON) -> median us of every timing the search had to choose from
    timed: dict[tuple[str, int, str], float] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.runs[-1]["status"] == "complete"

    @property
    def wall_s(self) -> float:
        """Seconds from each leg's start to its end (or its last stored row, for a killed leg)."""
        return sum(_seconds(r["started_at"], r["finished_at"] or r["last_row_at"]) for r in self.runs)


def _seconds(start: str | None, end: str | None) -> float:
    if not start or not end:
        return 0.0
    return max(0.0, (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds())


def _json(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def run_search(run: Mapping[str, Any]) -> str:
    """Which search a run was: its notes or search space say; runs from before the thorough search
    existed were pruned."""
    return str(_json(run["notes"]).get("search") or _json(run["search_space"]).get("search") or LEGACY_SEARCH)


def search_legs(
    tdb: store.TacticsDB, runs: Sequence[Mapping[str, Any]], search: str, gpu_name: str
) -> SearchLegs | None:
    """The latest run of ``search`` on ``gpu_name`` that recorded its sweeps, with the runs of the
    same search and environment before it back to the previous complete one (resumed legs)."""
    mine = [dict(r) for r in runs if run_search(r) == search and r["gpu_name"] == gpu_name]
    recorded = [i for i, r in enumerate(mine) if _json(r["notes"]).get("sweeps")]
    if not recorded:
        return None
    last = recorded[-1]
    env_hash = mine[last]["env_hash"]
    first = last
    while first > 0 and mine[first - 1]["env_hash"] == env_hash and mine[first - 1]["status"] != "complete":
        first -= 1
    legs = mine[first : last + 1]
    records = {s["problem_hash"]: s for s in _json(legs[-1]["notes"])["sweeps"]}
    elapsed: dict[str, float] = {}
    for leg in legs:
        for s in _json(leg["notes"]).get("sweeps", []):
            elapsed[s["problem_hash"]] = elapsed.get(s["problem_hash"], 0.0) + float(s.get("elapsed_s") or 0.0)
    # The timings the search compared: its own and those it took over from earlier runs; full
    # timings only (a thorough search's screens rank variants and are too short to compare).
    end = legs[-1]["finished_at"] or legs[-1]["last_row_at"] or ""
    timed = {
        (ph, int(m), tactic): float(row["median_us"])
        for ph in records
        for (m, tactic), row in tdb.measured(env_hash, ph).items()
        if row["status"] == "ok" and row["median_us"] is not None and row["measured_at"] <= end and not row.get("kind")
    }
    return SearchLegs(search, tdb.path, gpu_name, env_hash, legs, records, elapsed, timed)


def read_searches(paths: Iterable[str | os.PathLike[str]], gpu: str | None = None) -> dict[str, SearchLegs]:
    """The latest pruned and thorough search found in ``paths`` (the later one where several DBs
    hold one), on ``gpu`` (default: the GPU of the latest thorough run).

    Raises:
        TacticsError: a DB cannot be read, or holds no recorded thorough run.
    """
    found: dict[str, list[SearchLegs]] = {"pruned": [], "thorough": []}
    dbs = [str(p) for p in paths]
    runs_of: dict[str, list[dict[str, Any]]] = {}
    for path in dbs:
        with store.open_db_readonly(path) as tdb:
            runs_of[path] = tdb.runs()
    if gpu is None:
        recorded = [r for rs in runs_of.values() for r in rs if _json(r["notes"]).get("sweeps")]
        thorough_runs = sorted((r for r in recorded if run_search(r) == "thorough"), key=lambda r: r["started_at"])
        if not thorough_runs:
            raise TacticsError(f"no finished thorough run in {', '.join(dbs)}", hint="run `prepkit tune --thorough`")
        gpu = str(thorough_runs[-1]["gpu_name"])
    for path in dbs:
        with store.open_db_readonly(path) as tdb:
            for search, legs in found.items():
                got = search_legs(tdb, runs_of[path], search, gpu)
                if got is not None:
                    legs.append(got)
    return {s: max(legs, key=lambda x: x.runs[-1]["started_at"]) for s, legs in found.items() if legs}


def _miss(
    m: int, pruned: Mapping[str, Any] | None, thorough: Mapping[str, Any] | None, timed: Mapping[tuple[int, str], float]
) -> tuple[float | None, str | None]:
    """(how much slower the pruned pick is than the thorough pick, as a fraction; the basis)."""
    if not pruned or not thorough or pruned["winner_us"] is None or thorough["winner_us"] is None:
        return None, None
    if pruned["winner"] == thorough["winner"]:
        return 0.0, "same variant"
    same = timed.get((m, pruned["winner"]))
    if same is not None:
        return same / thorough["winner_us"] - 1.0, "thorough timings"
    if pruned["default_us"] and thorough["default_us"]:
        mine = pruned["winner_us"] / pruned["default_us"]
        theirs = thorough["winner_us"] / thorough["default_us"]
        return mine / theirs - 1.0, "vs default"
    return pruned["winner_us"] / thorough["winner_us"] - 1.0, "raw"


def compare(pruned: SearchLegs, thorough: SearchLegs, tokens: Iterable[int] | None = None) -> dict[str, Any]:
    """The comparison as plain data (what ``--json`` prints): per GEMM the rows per token count
    (those in ``tokens`` only, when given), each search's time and coverage; and each search's
    runs and wall time."""
    only = set(tokens) if tokens is not None else None
    gemms = []
    for ph, t_rec in thorough.records.items():
        p_rec = pruned.records.get(ph)
        if p_rec is None:
            continue
        p_pts = {pt["m"]: pt for pt in p_rec["points"]}
        t_pts = {pt["m"]: pt for pt in t_rec["points"]}
        timed = {(m, t): us for (h, m, t), us in thorough.timed.items() if h == ph}
        rows = []
        for m in sorted(set(p_pts) | set(t_pts)):
            if only is not None and m not in only:
                continue
            p, t = p_pts.get(m), t_pts.get(m)
            miss, basis = _miss(m, p, t, timed)
            rows.append(
                {
                    "m": m,
                    "default": (t or p or {}).get("default"),
                    "default_us": (t or p or {}).get("default_us"),
                    "pruned_us": p["winner_us"] if p else None,
                    "pruned": p["winner"] if p else None,
                    "pruned_is_default": bool(p and p["winner"] == p["default"]),
                    "thorough_us": t["winner_us"] if t else None,
                    "thorough": t["winner"] if t else None,
                    "thorough_is_default": bool(t and t["winner"] == t["default"]),
                    "miss_pct": None if miss is None else round(100 * miss, 2),
                    "miss_basis": basis,
                }
            )
        gemms.append(
            {
                "problem": t_rec["problem"],
                "problem_hash": ph,
                "activations": t_rec.get("act_dtype"),
                "pruned": {"elapsed_s": round(pruned.elapsed_s.get(ph, 0.0), 3), "coverage": p_rec.get("coverage")},
                "thorough": {
                    "elapsed_s": round(thorough.elapsed_s.get(ph, 0.0), 3),
                    "coverage": t_rec.get("coverage"),
                },
                "points": rows,
            }
        )
    return {
        "gpu": thorough.gpu_name,
        "searches": {
            legs.search: {
                "db": legs.db,
                "runs": [r["run_id"] for r in legs.runs],
                "complete": legs.complete,
                "wall_s": round(legs.wall_s, 3),
                "cmdline": legs.runs[-1]["cmdline"],
            }
            for legs in (pruned, thorough)
        },
        "gemms": gemms,
    }


SIDE_BY_SIDE = "side by side"


def retime(doc: dict[str, Any], problems: Mapping[str, ProblemKey], backend: Backend, rounds: int = 1) -> int:
    """Time every row's default, pruned pick and thorough pick again, fully and one after the
    other on ``backend``, ``rounds`` times, and take each row's times and miss from these (basis
    ``side by side``): the fairest comparison, since both searches' own timings come from
    different runs. Each round starts one pick later than the one before, so a clock that drifts
    within a round favours none. A row's times are the medians over the rounds and its miss the
    median of the rounds' misses; with several rounds, ``miss_range`` holds the lowest and highest
    round's miss. Rows whose timings fail keep what the DBs said. Returns how many rows were
    retimed."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    n = 0
    for g in doc["gemms"]:
        problem = problems[g["problem_hash"]]
        for row in g["points"]:
            picks = list(dict.fromkeys(t for t in (row["default"], row["pruned"], row["thorough"]) if t))
            taken: dict[str, list[float]] = {t: [] for t in picks}
            try:
                for r in range(rounds):
                    start = r % len(picks)
                    for t in picks[start:] + picks[:start]:
                        taken[t].append(backend.time(problem, t, row["m"]).median_us)
            except CandidateError:
                continue
            us = {t: statistics.median(v) for t, v in taken.items()}
            if row["default"]:
                row["default_us"] = us[row["default"]]
            if row["pruned"] and row["thorough"]:
                pairs = zip(taken[row["pruned"]], taken[row["thorough"]], strict=True)
                misses = [100 * (a / b - 1.0) for a, b in pairs]
                row["pruned_us"], row["thorough_us"] = us[row["pruned"]], us[row["thorough"]]
                row["miss_pct"] = round(statistics.median(misses), 2)
                row["miss_basis"] = SIDE_BY_SIDE
                if rounds > 1:
                    row["miss_range"] = [round(min(misses), 2), round(max(misses), 2)]
            n += 1
    doc["retimed"], doc["retime_rounds"] = n, rounds
    return n


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _variant(tactic: str | None, is_default: bool) -> str:
    if tactic is None:
        return "-"
    return "default" if is_default else short_tactic(tactic)


def _coverage(cov: Mapping[str, Any] | None) -> str:
    if not cov:
        return "coverage not recorded"
    valid = f" of {cov['valid']} valid" if cov.get("valid") is not None else ""
    return f"{cov['measured']}{valid} variants measured, {cov['failed']} failed"


def markdown(doc: Mapping[str, Any]) -> str:
    """The comparison as markdown: one table per GEMM, then each search's runs and time."""
    out = [f"## Pruned vs thorough search on {doc['gpu']}", ""]
    for g in doc["gemms"]:
        out += [
            f"### {g['problem']}",
            "",
            "| tokens | default µs | pruned µs | pruned variant | thorough µs | thorough variant | miss % |",
            "|---:|---:|---:|---|---:|---|---:|",
        ]
        for r in g["points"]:
            miss = "-" if r["miss_pct"] is None else f"{r['miss_pct']:.1f}"
            if r["miss_basis"] == "vs default":
                miss += "*"
            if r.get("miss_range"):
                miss += " ({:.1f} to {:.1f})".format(*r["miss_range"])
            out.append(
                f"| {r['m']} | {_us(r['default_us'])} | {_us(r['pruned_us'])} | "
                f"{_variant(r['pruned'], r['pruned_is_default'])} | {_us(r['thorough_us'])} | "
                f"{_variant(r['thorough'], r['thorough_is_default'])} | {miss} |"
            )
        out += [
            "",
            f"Pruned: {format_duration(g['pruned']['elapsed_s'])}, {_coverage(g['pruned']['coverage'])}. "
            f"Thorough: {format_duration(g['thorough']['elapsed_s'])}, {_coverage(g['thorough']['coverage'])}.",
            "",
        ]
    if doc.get("retimed"):
        note = (
            "µs and miss %: the default and both picks timed again side by side in one worker (`--retime`); "
            "miss %: how much slower the pruned pick is than the thorough pick."
        )
        rounds = doc.get("retime_rounds", 1)
        if rounds > 1:
            note += (
                f" Over {rounds} rounds, each starting one pick later: µs the median over the rounds, miss % the "
                "median of the rounds' misses, with the lowest and highest in brackets."
            )
        out.append(note)
    else:
        out.append(
            "miss %: how much slower the pruned pick is than the thorough pick, both as the thorough search "
            "timed them; * where it did not time the pruned pick there: each pick relative to its own run's default."
        )
    out.append("")
    for name, s in doc["searches"].items():
        legs = len(s["runs"])
        runs = f"{legs} run{'s' if legs > 1 else ''}" + ("" if s["complete"] else ", partial")
        out.append(f"- {name}: {format_duration(s['wall_s'])} in {runs} ({s['db']}): `{s['cmdline']}`")
    return "\n".join(out) + "\n"

"""``prepkit tune`` on the dense MX linears, on the CPU: which dense problems a model or a shard set
has, a sweep on a stand-in GPU recorded under dense keys that the runtime's dense lookup finds,
rows that never cross between MoE and dense, and the worker's dense check under the interpreter."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.errors import RecipeError
from prepkit.kernels.device import H100 as H100_INFO
from prepkit.kernels.tactic import GemmTactic
from prepkit.kernels.variants import dense_default, dense_invalid_reason, dense_sweep_space
from prepkit.tactics.keys import DENSE_ROLE, Environment, ProblemKey, canon, dense_problem, gpt_oss_problems
from prepkit.tactics.lookup import (
    TacticResolver,
    TacticsDBWarning,
    TacticTable,
    make_dense_tactic_lookup,
    make_tactic_lookup,
    suggest_tune_command,
)
from prepkit.tune import FunctionBackend, SubprocessBackend, TuneOptions, Worker, kernel_candidates, kernel_defaults
from prepkit.tune import run as tune_run
from prepkit.tune.dense import dense_shapes, dense_targets

H100_ENV = Environment.of(H100_INFO)
POINTS = (1, 2, 8, 64)
GPT_OSS_DENSE = {"qkv": (5120, 2880), "o": (2880, 4096), "lm_head": (201088, 2880)}


def kernel_version() -> str:
    from prepkit.kernels.mx import KERNEL_VERSION

    return str(KERNEL_VERSION)


def shapes_of(targets: list[Any]) -> list[tuple[str, int, int]]:
    return [(t.problem.w_dtype, t.problem.n, t.problem.k) for t in targets]


# ------------------------------------------------------------------------------ the problems


@pytest.mark.parametrize("model", ["gpt-oss-120b", "gpt-oss-20b"])
def test_a_model_has_fused_qkv_o_and_lm_head_in_both_formats(model: str) -> None:
    targets = dense_targets(model=model, shards=None, choice=None, kernel_version=kernel_version())
    expected = [(w, n, k) for w in ("mxfp4_e2m1", "mxfp8_e4m3") for n, k in GPT_OSS_DENSE.values()]
    assert shapes_of(targets) == expected
    assert [t.label for t in targets[:3]] == [
        "dense mxfp4 qkv 5120x2880", "dense mxfp4 o 2880x4096", "dense mxfp4 lm_head 201088x2880",
    ]  # fmt: skip
    for t in targets:
        assert t.problem.role == DENSE_ROLE and t.problem.weight_layout == "dense_mx_v1"
        assert (t.problem.num_experts, t.problem.top_k, t.problem.act_dtype) == (1, 1, "bf16")
    # the keys are the ones the runtime's dense lookup builds
    assert targets[0].problem == dense_problem(
        kernel="moe_mxfp4", kernel_version=kernel_version(), weight_layout="dense_mx_v1", n=5120, k=2880, fmt="mxfp4"
    )


def test_the_dense_choice_and_the_activation_policy_pick_the_formats() -> None:
    def formats(choice: str | None, activations: str = "bf16") -> list[str]:
        ts = dense_targets(
            model="gpt-oss-120b", shards=None, choice=choice, kernel_version="1",
            activations=activations,  # type: ignore[arg-type]
        )  # fmt: skip
        return sorted({t.problem.w_dtype for t in ts})

    assert formats("none") == []
    assert formats("mxfp8") == ["mxfp8_e4m3"]
    assert formats("all") == formats(None) == ["mxfp4_e2m1", "mxfp8_e4m3"]
    assert formats(None, "mxfp4") == ["mxfp4_e2m1"]  # mxfp4 activations need mxfp4 weights
    assert formats(None, "mxfp8") == ["mxfp4_e2m1", "mxfp8_e4m3"]
    with pytest.raises(RecipeError, match="they need mxfp4 weights, not mxfp8"):
        formats("mxfp8", "mxfp4")
    acts = dense_targets(model=None, shards=None, choice="mxfp4", kernel_version="1", activations="mxfp8")
    assert {t.problem.act_dtype for t in acts} == {"mxfp8"} and acts[0].label.endswith(" act=mxfp8")


def test_dense_shapes_follow_the_config() -> None:
    cfg = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 96}
    assert [(s.name, s.n, s.k) for s in dense_shapes(cfg)] == [
        ("qkv", 256, 256), ("o", 256, 128), ("lm_head", 96, 256),
    ]  # fmt: skip
    with pytest.raises(RecipeError, match="head_dim"):
        dense_shapes({**cfg, "head_dim": 0})


def _prepare(src: Path, out: Path, dense: str) -> Path:
    args = ["prepare", "--src", str(src), "--layout", "triton-moe", "--tp", "1", "--out", str(out), "-q"]
    r = CliRunner().invoke(cli, [*args, "--dense", dense])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prepkit.synth import write_synthetic_checkpoint

    return write_synthetic_checkpoint(
        tmp_path_factory.mktemp("dense") / "src", num_layers=1, num_experts=4, hidden=256, intermediate=256,
        vocab_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32, seed=3,
    )  # fmt: skip


def test_a_shard_set_has_the_format_its_manifest_records(small_ckpt: Path, tmp_path: Path) -> None:
    mx = _prepare(small_ckpt, tmp_path / "mx", "mxfp4")
    targets = dense_targets(model=None, shards=mx, choice=None, kernel_version="1")
    assert shapes_of(targets) == [("mxfp4_e2m1", 256, 256), ("mxfp4_e2m1", 256, 128), ("mxfp4_e2m1", 96, 256)]
    assert dense_targets(model=None, shards=mx, choice="all", kernel_version="1") == targets
    assert dense_targets(model=None, shards=mx, choice="none", kernel_version="1") == []
    with pytest.raises(RecipeError, match="holds dense weights in mxfp4"):
        dense_targets(model=None, shards=mx, choice="mxfp8", kernel_version="1")

    bf16 = _prepare(small_ckpt, tmp_path / "bf16", "bf16")
    assert dense_targets(model=None, shards=bf16, choice=None, kernel_version="1") == []
    assert dense_targets(model=None, shards=bf16, choice="all", kernel_version="1") == []
    with pytest.raises(RecipeError, match="holds bf16 dense weights"):
        dense_targets(model=None, shards=bf16, choice="mxfp4", kernel_version="1")


# ------------------------------------------------------------------------------ candidates


def test_dense_candidates_are_the_sweep_space_of_the_points_pruned() -> None:
    p = dense_problem(kernel="moe_mxfp4", kernel_version="1", weight_layout="dense_mx_v1", n=5120, k=2880, fmt="mxfp4")
    union = {canon(t) for m in POINTS for t in dense_sweep_space("mxfp4", H100_INFO, m, 5120, 2880)}
    cands = kernel_candidates(p, H100_INFO, max_count=24, points=POINTS)
    assert len(cands) == 24 < len(union) and set(cands) <= union
    everything = kernel_candidates(p, H100_INFO, points=POINTS)
    assert set(everything) == union  # nothing valid is pruned without a budget: split K stays
    assert any(json.loads(t)["split_k"] > 1 for t in everything)
    defaults = kernel_defaults(p, H100_INFO)
    assert defaults(1) == canon(dense_default(1, 5120, 2880, "mxfp4", H100_INFO))
    assert {defaults(m) for m in (1, 2, 8)} <= set(cands)  # the defaults seed the pruned set
    for t in cands:
        assert dense_invalid_reason(GemmTactic.from_json(t), "mxfp4", H100_INFO) is None


# ------------------------------------------------------------------------------ a sweep


def dense_timer(t: str, m: int) -> list[float]:
    """The stand-in GPU: a K split in two and four stages are fastest, whatever the default is."""
    d = json.loads(t)
    us = (4.0 + m * 0.05) * (1 + 0.2 * (d["split_k"] != 2) + 0.1 * (d["num_stages"] != 4) + 0.01 * d["block_n"] / 64)
    return [us * (1 + 0.001 * i) for i in range(9)]


class StandIn(FunctionBackend):
    def __init__(self) -> None:
        super().__init__(dense_timer, lambda t: json.loads(t)["block_n"] != 32)
        self.roles: set[str] = set()
        self.timed: list[tuple[ProblemKey, str, int]] = []

    def check(self, problem: ProblemKey, tactic: str) -> Any:
        self.roles.add(problem.role)
        return super().check(problem, tactic)

    def time(self, problem: ProblemKey, tactic: str, m: int, screen: Any = None) -> Any:
        self.roles.add(problem.role)
        self.timed.append((problem, tactic, m))
        return super().time(problem, tactic, m, screen)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> StandIn:
    backend = StandIn()
    monkeypatch.setattr(tune_run, "open_gpu_workers", lambda gpus, env=None: [Worker(backend, H100_ENV, H100_INFO)])
    monkeypatch.setattr(tune_run, "bundled_db_path", lambda: None)
    return backend


def test_a_dense_sweep_records_winners_the_dense_lookup_serves(stand_in: StandIn, tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    opts = TuneOptions(
        arch="sm90", model="gpt-oss-120b", points=POINTS, db_path=db, max_candidates=16, dense_formats="mxfp4",
        moe=False,
        cmdline=["test"],
    )  # fmt: skip
    report = tune_run.run_tune(opts)
    assert report.status == "complete" and stand_in.roles == {DENSE_ROLE}
    assert [r.label for r in report.layer.results] == [
        "dense mxfp4 qkv 5120x2880", "dense mxfp4 o 2880x4096", "dense mxfp4 lm_head 201088x2880",
    ]  # fmt: skip
    with sqlite3.connect(db) as c:
        roles = c.execute(
            "SELECT DISTINCT k.role FROM winner JOIN problem p USING (problem_hash) JOIN kernel k USING (kernel_hash)"
        ).fetchall()
    assert roles == [("dense",)]

    res = TacticResolver(user_db=db, bundled_db=False)
    lookup = make_dense_tactic_lookup(resolver=res, kernel_version=kernel_version())
    beaten = 0
    for result in report.layer.results:
        n, k = result.problem.n, result.problem.k
        for choice in result.choices:
            assert choice.winner is not None
            served = lookup(choice.m, n, k, "mxfp4", "bf16", H100_INFO)
            assert served == GemmTactic.from_json(choice.winner)
            assert json.loads(choice.winner)["block_n"] != 32  # failed its check: never a winner
            beaten += served != dense_default(choice.m, n, k, "mxfp4", H100_INFO)
    assert beaten > 0  # the stand-in's fastest variants are no defaults: the lookup serves tuned rows
    # rows of another format or policy are not these
    assert res.lookup(dense_problem(**{**_key_args(report), "fmt": "mxfp8"}), 1, H100_INFO, warn=False) is None

    # a rerun times nothing it timed before (the winners seed it, so their neighbours may be new)
    first = set(stand_in.timed)
    stand_in.timed.clear()
    again = tune_run.run_tune(opts)
    assert first and not first & set(stand_in.timed)
    assert all(r.n_reused > 0 for r in again.layer.results)


def _key_args(report: Any) -> dict[str, Any]:
    p = report.layer.results[0].problem
    return {"kernel": p.kernel, "kernel_version": p.kernel_version, "weight_layout": p.weight_layout, "n": p.n,
            "k": p.k}  # fmt: skip


def test_dense_none_sweeps_no_dense_problem(stand_in: StandIn, tmp_path: Path) -> None:
    r = CliRunner().invoke(
        cli, ["tune", "--arch", "sm90", "--db", str(tmp_path / "t.db"), "--tokens", "1,8", "--max-candidates", "6",
              "--dense-formats", "none", "--json", "-q"],
        catch_exceptions=False,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert [p["problem"].split()[0] for p in json.loads(r.output)["problems"]] == ["gemm1", "gemm2"]
    assert stand_in.roles == {"gemm1", "gemm2"}


def test_the_cli_names_dense_problems_in_progress_and_summary(stand_in: StandIn, tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    args = ["tune", "--arch", "sm90", "--db", str(db), "--tokens", "1,8", "--max-candidates", "6", "--no-moe"]
    r = CliRunner().invoke(cli, [*args, "--dense-formats", "mxfp8"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    for name in ("dense mxfp8 qkv 5120x2880", "dense mxfp8 o 2880x4096", "dense mxfp8 lm_head 201088x2880"):
        assert name in r.output
    out = json.loads(CliRunner().invoke(cli, [*args, "--dense-formats", "mxfp8", "--json", "-q"]).output)
    assert [p["name"] for p in out["problems"]] == [
        "dense mxfp8 qkv 5120x2880", "dense mxfp8 o 2880x4096", "dense mxfp8 lm_head 201088x2880",
    ]  # fmt: skip
    shown = " ".join(CliRunner().invoke(cli, ["tactics", "show", "--db", str(db)]).output.split())
    assert "dense mxfp8 N=5120 K=2880" in shown and "dense mxfp8 N=201088 K=2880" in shown
    r = CliRunner().invoke(cli, ["tune", "--arch", "sm90", "--db", str(db), "--no-moe", "--dense-formats", "none"])
    assert r.exit_code == 3 and "nothing to tune" in r.output


# ------------------------------------------------------------------------------ no crossing


def test_a_lookup_never_crosses_moe_and_dense(tmp_path: Path) -> None:
    """A MoE GEMM and a dense linear of the same N and K: each lookup finds its own rows only."""
    from prepkit.tactics.store import WinnerRow, env_record, open_db

    version = kernel_version()
    moe = gpt_oss_problems(kernel="moe_mxfp4", kernel_version=version, weight_layout="triton_moe_v3")
    dense = dense_problem(
        kernel="moe_mxfp4", kernel_version=version, weight_layout="dense_mx_v1", n=moe["gemm2"].n,
        k=moe["gemm2"].k, fmt="mxfp4",
    )  # fmt: skip
    moe_tactic = kernel_defaults(moe["gemm2"], H100_INFO)(4)
    dense_tactic = kernel_defaults(dense, H100_INFO)(4)
    assert moe_tactic != dense_tactic
    db = tmp_path / "t.db"
    with open_db(db) as tdb:
        env_hash = tdb.put_env(env_record(H100_ENV, package_version="0"))
        run = tdb.start_run(env_hash, timing_method={}, search_space={}, token_points=[1, 8])
        for p, t in ((moe["gemm2"], moe_tactic), (dense, dense_tactic)):
            tdb.put_problem(p)
            tdb.replace_winners(env_hash, p.problem_hash(), run, [WinnerRow(1, 8192, t, True)])
        tdb.finish_run(run, "complete")

    def served(p: ProblemKey) -> str | None:
        return TacticTable.load(p, H100_ENV, user_db=db, bundled_db=False).tactic_for(4)

    assert served(moe["gemm2"]) == moe_tactic and served(dense) == dense_tactic
    assert served(moe["gemm1"]) is None  # no row of its own; the dense one is not it
    other = dense_problem(
        kernel="moe_mxfp4", kernel_version=version, weight_layout="dense_mx_v1", n=moe["gemm1"].n,
        k=moe["gemm1"].k, fmt="mxfp4",
    )  # fmt: skip
    assert served(other) is None

    res = TacticResolver(user_db=db, bundled_db=False)
    dense_lookup = make_dense_tactic_lookup(resolver=res, kernel_version=version)
    assert dense_lookup(4, dense.n, dense.k, "mxfp4", "bf16", H100_INFO) == GemmTactic.from_json(dense_tactic)
    moe_lookup = make_tactic_lookup(resolver=res, kernel_version=version)
    from prepkit.layer import rank_layer
    from prepkit.recipes import load_recipe, model_dims

    layer = rank_layer(model_dims(load_recipe("gpt-oss-120b").reference_dims))
    with pytest.warns(TacticsDBWarning, match="no tuned tactics for gemm1"):  # the dense row does not serve it
        pair = moe_lookup(layer.problem(4), H100_INFO)
    assert pair is not None and pair[1] == GemmTactic.from_json(moe_tactic)


def test_a_dense_miss_names_the_dense_tune_command() -> None:
    common = {"kernel": "moe_mxfp4", "kernel_version": "1", "weight_layout": "dense_mx_v1"}
    head = dense_problem(n=201088, k=2880, fmt="mxfp8", act_dtype="mxfp8", **common)
    assert suggest_tune_command(head, "sm90") == (
        "prepkit tune --arch sm90 --model gpt-oss-120b --dense-formats mxfp8 --no-moe --activations mxfp8"
    )
    odd = dense_problem(n=96, k=256, fmt="mxfp4", **common)
    assert suggest_tune_command(odd, "sm121") == "prepkit tune --arch sm121 --shards DIR --dense-formats mxfp4 --no-moe"


# ------------------------------------------------------------------------------ the worker


def test_the_real_worker_checks_and_times_a_dense_problem() -> None:
    """The worker under the interpreter, on a tiny dense shape: a valid variant passes against the
    dequantized weight, and timing returns samples."""
    p = dense_problem(kernel="moe_mxfp4", kernel_version="1", weight_layout="dense_mx_v1", n=80, k=352, fmt="mxfp8")
    t = canon(dense_default(1, 80, 352, "mxfp8", H100_INFO))
    b = SubprocessBackend(env={"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}, check_m=(1, 33))
    try:
        res = b.check(p, t)
        timing = b.time(p, t, 3)
    finally:
        b.close()
    assert res.passed and res.m_values == (1, 33) and res.reference == "fp32_dequant/bf16"
    assert res.rel_err is not None and 0 < res.rel_err < 2e-2
    assert timing.median_us > 0 and timing.n_samples == 3


def test_thorough_check_workers_fit_the_lm_head_in_gpu_memory() -> None:
    """Each check worker holds the lm_head's MX weight and its bf16 copy: fewer fit than cores."""
    from prepkit.tune import thorough

    head = dense_problem(kernel="moe_mxfp4", kernel_version="1", weight_layout="dense_mx_v1", n=201088, k=2880,
                         fmt="mxfp8")  # fmt: skip
    assert thorough.layer_weight_bytes(head) > 201088 * 2880 * 3
    workers = thorough.check_workers(32, 80 << 30, thorough.layer_weight_bytes(head))
    assert 1 < workers < 32
    assert workers * (2 * thorough.layer_weight_bytes(head) + thorough.WORKER_OVERHEAD_BYTES) < 80 << 30

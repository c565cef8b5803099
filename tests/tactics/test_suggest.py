"""The tune command a missed problem's warning names: the model comes from the shipped recipes'
dims, not from shapes written into the lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prepkit import recipes
from prepkit.layer import rank_layer
from prepkit.layouts.base import RankSpec
from prepkit.tactics import suggest
from prepkit.tactics.keys import dense_problem, layer_problems
from prepkit.tactics.suggest import suggest_tune_command

ROOT = Path(__file__).resolve().parents[2]
COMMON = {"kernel": "moe_mxfp4", "kernel_version": "1", "weight_layout": "triton_moe_v3"}


def _moe(config: dict[str, int], tp: int = 1):  # type: ignore[no-untyped-def]
    layer = rank_layer(recipes.model_dims(config), RankSpec(tp_size=tp))
    return layer_problems(layer, **COMMON)


@pytest.fixture
def recipe_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A recipes folder with gpt-oss-20b and a made-up smaller model of the same family."""
    raw = json.loads((ROOT / "recipes" / "gpt-oss-20b.json").read_text())
    (tmp_path / "gpt-oss-20b.json").write_text(json.dumps(raw))
    small = {**raw, "name": "mini-moe"}
    small["reference_dims"] = {**raw["reference_dims"], "num_local_experts": 16, "hidden_size": 1024,
                               "intermediate_size": 512, "vocab_size": 32000, "num_attention_heads": 16}  # fmt: skip
    (tmp_path / "mini-moe.json").write_text(json.dumps(small))
    monkeypatch.setenv(recipes.RECIPES_ENV, str(tmp_path))
    suggest.shipped_models.cache_clear()
    yield tmp_path
    suggest.shipped_models.cache_clear()


def test_a_shipped_recipe_names_its_model_for_moe_and_dense(recipe_dir: Path) -> None:
    mini = json.loads((recipe_dir / "mini-moe.json").read_text())["reference_dims"]
    for tp in (1, 2):
        assert suggest_tune_command(_moe(mini, tp)["gemm2"], "sm90") == (
            f"prepkit tune --arch sm90 --model mini-moe --tp {tp}"
        )
    qkv = dense_problem(n=(16 + 2 * 8) * 64, k=1024, fmt="mxfp4", **COMMON)
    assert (
        suggest_tune_command(qkv, "sm90") == "prepkit tune --arch sm90 --model mini-moe --dense-formats mxfp4 --no-moe"
    )
    # gpt-oss-120b is not in this folder: its layer is no shipped model's
    big = json.loads((ROOT / "recipes" / "gpt-oss-120b.json").read_text())["reference_dims"]
    assert "--shards DIR" in suggest_tune_command(_moe(big)["gemm1"], "sm90")
    head = dense_problem(n=201088, k=2880, fmt="mxfp8", act_dtype="mxfp8", **COMMON)
    assert suggest_tune_command(head, "sm90") == (
        "prepkit tune --arch sm90 --model gpt-oss-20b --dense-formats mxfp8 --no-moe --activations mxfp8"
    )


def test_the_bundled_recipes_name_gpt_oss() -> None:
    suggest.shipped_models.cache_clear()
    for name in ("gpt-oss-120b", "gpt-oss-20b"):
        dims = json.loads((ROOT / "recipes" / f"{name}.json").read_text())["reference_dims"]
        assert f"--model {name} --tp 4" in suggest_tune_command(_moe(dims, 4)["gemm1"], "sm90")
    odd = dense_problem(n=96, k=64, fmt="mxfp4", **COMMON)
    assert suggest_tune_command(odd, "sm121") == "prepkit tune --arch sm121 --shards DIR --dense-formats mxfp4 --no-moe"


def test_the_lookup_holds_no_model_shapes() -> None:
    """No GEMM shape of a model is spelled in the lookup's modules: they come from the recipes."""
    tactics = ROOT / "prepkit" / "tactics"
    for name in ("lookup.py", "resolver.py", "table.py", "adapters.py", "suggest.py"):
        text = (tactics / name).read_text()
        assert not any(shape in text for shape in ("2880", "5120", "201088", "4096")), name

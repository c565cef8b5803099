"""Hugging Face transformers' gpt-oss on a ``prepkit synth`` checkpoint, with and without
prepkit's MoE swapped in: transformers is an independent reader of the checkpoint format and an
independent implementation of the gpt-oss MoE math.

CPU runs use the Triton interpreter at tiny dims; the GPU test uses the real hidden size."""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

if not torch.cuda.is_available():
    # Triton picks interpreter or compiler when the kernel module is imported: decide before that.
    os.environ.setdefault("TRITON_INTERPRET", "1")

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'prepkit-gpt-oss[test]')")

from prepkit import mxfp4  # noqa: E402
from prepkit.cli import cli  # noqa: E402
from prepkit.errors import DependencyError, DeviceError, LayoutError, RecipeError  # noqa: E402
from prepkit.integrations.transformers import (  # noqa: E402
    PrepkitMoeBlock,
    check_transformers_version,
    use_prepkit_moe,
)
from prepkit.kernels.reference import relative_error  # noqa: E402
from prepkit.synth import write_synthetic_checkpoint  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = {"num_layers": 2, "num_experts": 4, "hidden": 64, "intermediate": 64, "top_k": 2, "vocab_size": 256}
# bf16 activations through both paths: measured 0.5 % relative on the logits at these dims.
LOGITS_TOL = 2e-2
PROMPT = [[3, 17, 42, 99, 7, 128, 200, 11]]


def _prepare(src: Path, out: Path, *extra: str) -> Path:
    result = CliRunner().invoke(cli, ["prepare", "--src", str(src), "--out", str(out), "-q", *extra])
    assert result.exit_code == 0, result.output
    return out


def load_reference(src: Path, device: str = "cpu") -> torch.nn.Module:
    """transformers' own model: MXFP4 experts dequantized to bf16 on load."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(src),
            quantization_config=transformers.Mxfp4Config(dequantize=True),
            dtype=torch.bfloat16,
        )
    return model.to(device).eval()  # device_map would need accelerate


def swapped(src: Path, prepared: Path, device: str = "cpu", **kwargs: str) -> torch.nn.Module:
    model = load_reference(src, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tuned tactic for tiny dims; the default serves
        return use_prepkit_moe(model, prepared, **kwargs)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("tf") / "model", num_shards=2, seed=7, **TINY)


@pytest.fixture(scope="module")
def prepared(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _prepare(source, tmp_path_factory.mktemp("tf") / "triton", "--layout", "triton-moe")


def test_synthetic_checkpoint_loads_with_the_same_expert_values(source: Path) -> None:
    from safetensors.torch import load_file

    model = load_reference(source)
    raw: dict[str, torch.Tensor] = {}
    for path in source.glob("*.safetensors"):
        raw.update(load_file(str(path)))
    for layer in range(TINY["num_layers"]):
        experts = model.model.layers[layer].mlp.experts
        prefix = f"model.layers.{layer}.mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):
            ours = mxfp4.dequantize(raw[prefix + proj + "_blocks"], raw[prefix + proj + "_scales"])
            # transformers keeps [E, in, out]; the checkpoint [E, out, in]. Every value is bf16-exact.
            theirs = getattr(experts, proj).detach().float().transpose(1, 2)
            assert torch.equal(theirs, ours.float()), (layer, proj)
            assert torch.equal(getattr(experts, proj + "_bias").detach(), raw[prefix + proj + "_bias"])


def test_swapped_model_matches_transformers(source: Path, prepared: Path, interpreter: None) -> None:
    reference = load_reference(source)
    model = swapped(source, prepared)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        want = reference(ids).logits.float()
        got = model(ids).logits.float()
        assert relative_error(got, want) < LOGITS_TOL
        # Each block alone, on unit-scale inputs: same output, same router scores.
        x = torch.randn(1, 5, TINY["hidden"], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        for layer in range(TINY["num_layers"]):
            want_h, want_scores = reference.model.layers[layer].mlp(x)
            got_h, got_scores = model.model.layers[layer].mlp(x)
            assert got_h.shape == want_h.shape and got_h.dtype == want_h.dtype
            assert relative_error(got_h.float(), want_h.float()) < LOGITS_TOL
            assert torch.equal(got_scores, want_scores)
        want_tokens = reference.generate(ids, max_new_tokens=5, do_sample=False)
        got_tokens = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(got_tokens, want_tokens)


def test_other_experts_fail_the_tolerance(source: Path, tmp_path: Path, interpreter: None) -> None:
    # The comparison above can fail: experts of another seed move the logits far past the tolerance.
    other = write_synthetic_checkpoint(tmp_path / "other", seed=8, **TINY)
    model = swapped(source, _prepare(other, tmp_path / "other-triton", "--layout", "triton-moe"))
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        assert relative_error(model(ids).logits.float(), load_reference(source)(ids).logits.float()) > 5 * LOGITS_TOL


def test_swap_frees_the_expert_parameters(source: Path, prepared: Path, interpreter: None) -> None:
    model = load_reference(source)
    before = sum(p.numel() for p in model.parameters())
    E, H, I = TINY["num_experts"], TINY["hidden"], TINY["intermediate"]
    per_layer = E * (H * 2 * I + 2 * I + I * H + H)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        use_prepkit_moe(model, prepared)
    assert sum(p.numel() for p in model.parameters()) == before - TINY["num_layers"] * per_layer
    assert not any(type(m).__name__ == "GptOssExperts" for m in model.modules())
    blocks = [layer.mlp for layer in model.model.layers]
    assert all(isinstance(b, PrepkitMoeBlock) for b in blocks)
    assert not any("experts" in name for name in model.state_dict())
    with pytest.raises(RecipeError, match="already runs prepkit"):
        use_prepkit_moe(model, prepared)


@pytest.mark.parametrize(
    ("key", "value", "manifest_side"),
    [
        ("num_local_experts", 8, "num_experts is 4"),
        ("num_experts_per_tok", 3, "top_k is 2"),
        ("intermediate_size", 128, "intermediate is 64"),
        ("num_hidden_layers", 3, "num_layers is 2"),
        ("swiglu_limit", 9.0, "say 7.0"),
    ],
)
def test_a_config_that_differs_is_named_with_both_values(
    source: Path, prepared: Path, key: str, value: float, manifest_side: str, interpreter: None
) -> None:
    model = load_reference(source)
    setattr(model.config, key, value)
    with pytest.raises(RecipeError, match=rf"{key}: the model config says {value}.*{manifest_side}"):
        use_prepkit_moe(model, prepared)
    assert not any(isinstance(layer.mlp, PrepkitMoeBlock) for layer in model.model.layers)


def test_other_layouts_and_splits_are_refused(source: Path, tmp_path: Path, interpreter: None) -> None:
    model = load_reference(source)
    gen = _prepare(source, tmp_path / "gen", "--layout", "trtllm-gen")
    with pytest.raises(LayoutError, match="'trtllm_gen_v1'.*'triton_moe_v3'"):
        use_prepkit_moe(model, gen)
    tp2 = _prepare(source, tmp_path / "tp2", "--layout", "triton-moe", "--tp", "2")
    with pytest.raises(LayoutError, match="tp=2 ep=1.*tp=1 ep=1"):
        use_prepkit_moe(model, tp2)


def test_cpu_layers_need_the_interpreter(
    source: Path, prepared: Path, monkeypatch: pytest.MonkeyPatch, interpreter: None
) -> None:
    model = load_reference(source)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DeviceError, match="Triton interpreter"):
        use_prepkit_moe(model, prepared)


def test_not_a_gpt_oss_model_is_refused(prepared: Path) -> None:
    with pytest.raises(RecipeError, match="model_type.*'gpt_oss'"):
        use_prepkit_moe(torch.nn.Linear(2, 2), prepared)


@pytest.mark.parametrize("version", ["4.55.0", "6.0.0", "5.22.1", "nightly"])
def test_unsupported_transformers_versions_are_refused(version: str) -> None:
    with pytest.raises(DependencyError, match="transformers") as refused:
        check_transformers_version(version)
    assert refused.value.exit_code == 3  # as before it had a class of its own


def test_the_installed_and_tested_versions_are_supported() -> None:
    assert check_transformers_version("5.23.0") == "5.23.0"
    assert check_transformers_version() == transformers.__version__


# Relative error of one MoE block against transformers' bf16 experts, per activation policy: bf16
# is the kernel's accumulation-order difference; mxfp8 / mxfp4 quantize the activations (prepkit
# measures about 5 % and 21 % against the unquantized layer on an H100), with headroom. Measured
# on an H100 (block / logits / argmax agreement): bf16 0.6 % / 5.7 % / 98 %, mxfp8 5.2 % / 14 %,
# mxfp4 21 % / 42 %.
GPU_BLOCK_TOL = {"bf16": 2e-2, "mxfp8": 8e-2, "mxfp4": 3e-1}
LOGITS_FACTOR = 5
REAL = {"num_layers": 2, "num_experts": 128, "hidden": 2880, "intermediate": 2880, "top_k": 4, "vocab_size": 1024}


@pytest.fixture(scope="module")
def real_prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tf-real")
    src = write_synthetic_checkpoint(root / "model", seed=11, **REAL)
    return src, _prepare(src, root / "triton", "--layout", "triton-moe")


@pytest.mark.gpu
@pytest.mark.slow
def test_real_dims_on_the_gpu_match_transformers_bf16(real_prepared: tuple[Path, Path]) -> None:
    src, prepared = real_prepared
    reference = load_reference(src, "cuda")
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, REAL["vocab_size"] - 4, (2, 48), generator=g).cuda()
    x = torch.randn(2, 48, REAL["hidden"], generator=g).to(torch.bfloat16).cuda()
    with torch.no_grad():
        want_logits = reference(ids).logits.float()
        want_blocks = [layer.mlp(x)[0].float() for layer in reference.model.layers]
    errors: dict[str, tuple[float, float, float]] = {}  # block error, logits error, argmax agreement
    for policy in GPU_BLOCK_TOL:
        # A copy on the GPU instead of a second load: transformers dequantizes on the CPU.
        model = copy.deepcopy(reference)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no tuned tactic, or MX activations decomposed on Hopper
            use_prepkit_moe(model, prepared, activations=policy)
            block_err = max(
                relative_error(layer.mlp(x)[0].float(), want)
                for layer, want in zip(model.model.layers, want_blocks, strict=True)
            )
            got_logits = model(ids).logits.float()
        agree = float((got_logits.argmax(-1) == want_logits.argmax(-1)).float().mean())
        errors[policy] = (block_err, relative_error(got_logits, want_logits), agree)
        del model
        torch.cuda.empty_cache()
    print(errors)
    for policy, tol in GPU_BLOCK_TOL.items():
        assert errors[policy][0] < tol, errors
        # Two layers compound the block error (and a near tie in the router can flip an expert).
        assert errors[policy][1] < LOGITS_FACTOR * tol, errors
    assert errors["bf16"][2] >= 0.95, errors  # next-token choice: bf16 agrees almost everywhere
    # The policies are what they claim: coarser activations, larger error.
    assert errors["bf16"][0] < errors["mxfp8"][0] < errors["mxfp4"][0], errors

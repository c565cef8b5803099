"""The decode step with prepkit's decode kernels as its ops (``PrepkitDecoder(kernels=True)``)
against the eager step of torch ops, on tiny synthetic models (the interpreter on the CPU), and
its launches per layer on a GPU."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("transformers", reason="needs transformers (pip install 'prepkit-gpt-oss[test]')")
pytest.importorskip("triton")

from prepkit.generation.sampling import SamplingParams  # noqa: E402
from prepkit.integrations import kernel_ops  # noqa: E402
from prepkit.integrations.static_decode import PrepkitDecoder  # noqa: E402
from prepkit.integrations.transformers import from_prepared  # noqa: E402
from prepkit.kernels.decode import gemv  # noqa: E402
from prepkit.synth import write_synthetic_checkpoint  # noqa: E402

from .test_decode_rows import _left_padded  # noqa: E402
from .test_transformers import TINY, _prepare  # noqa: E402

LENGTHS = (7, 3, 10)
NEW = 5
# Relative to the largest logit: the kernels sum in another order than torch's GEMMs and keep the
# MoE output in fp32 until it is added; measured near 1e-3 at these dims.
TOL = 2e-2


def _model(tmp: Path, dense: str, layers: int = TINY["num_layers"], device: str = "cpu") -> torch.nn.Module:
    src = write_synthetic_checkpoint(tmp / f"model{layers}", seed=37, **{**TINY, "num_layers": layers})
    extra = ("--dense", dense) if dense != "bf16" else ()
    prepared = _prepare(src, tmp / f"{dense}{layers}", "--layout", "triton-moe", *extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tuned tactic for tiny dims; the defaults serve
        model = from_prepared(prepared, device=device)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module", params=["bf16", "mxfp4"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return _model(tmp_path_factory.mktemp("kops"), request.param, device=device)


def _logits_per_step(decoder: PrepkitDecoder, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    # Eager steps (``cuda_graph=False``): a captured graph's replays would pass no Python code.
    seen: list[torch.Tensor] = []
    step = decoder._step

    def recording() -> None:
        step()
        assert decoder.logits is not None
        seen.append(decoder.logits.clone())

    decoder._step = recording  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decoder.generate(ids, NEW, attention_mask=mask)
    return seen


def _assert_same_steps(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Each step's logits within TOL of the torch step's (relative to its largest), the same greedy tokens."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        err = (a.float() - b.float()).abs().max() / b.float().abs().max()
        assert err < TOL, f"step {i}: {err:.3g}"
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"step {i}: another greedy token"


def test_kernel_ops_give_the_torch_steps_logits_and_tokens(model: torch.nn.Module) -> None:
    ids, mask = _left_padded(LENGTHS, pad_id=0)
    length, batch = ids.shape[1] + NEW, len(LENGTHS)
    ref = PrepkitDecoder(model, length, batch_size=batch, keep_logits=True, cuda_graph=False)
    fast = PrepkitDecoder(model, length, batch_size=batch, keep_logits=True, cuda_graph=False, kernels=True)
    want, got = _logits_per_step(ref, ids, mask), _logits_per_step(fast, ids, mask)
    assert len(got) == len(want) == NEW - 1
    _assert_same_steps(got, want)


def test_an_lm_head_on_tensor_cores_gives_the_torch_steps_logits(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tiny vocabulary is no stream; the rule is widened to it so that the norm-only launch and
    # the dense MX kernel run this lm_head, as they run the real mxfp4 one.
    if not hasattr(model.lm_head, "weight_blocks"):
        pytest.skip("a bf16 lm_head stays on the GEMV")
    vocab = model.lm_head.out_features
    norms: list[int] = []
    add_norm = gemv.add_norm

    def counted(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        norms.append(1)
        return add_norm(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel_ops, "on_tensor_cores", lambda n, fmt: fmt == "mxfp4" and n == vocab)
    monkeypatch.setattr(gemv, "add_norm", counted)
    ids, mask = _left_padded(LENGTHS, pad_id=0)
    length, batch = ids.shape[1] + NEW, len(LENGTHS)
    ref = PrepkitDecoder(model, length, batch_size=batch, keep_logits=True, cuda_graph=False)
    fast = PrepkitDecoder(model, length, batch_size=batch, keep_logits=True, cuda_graph=False, kernels=True)
    want, got = _logits_per_step(ref, ids, mask), _logits_per_step(fast, ids, mask)
    assert len(norms) == NEW - 1  # one lm_head a step, and only the lm_head
    _assert_same_steps(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU twin: the test above)")
def test_the_real_mxfp4_lm_head_runs_on_tensor_cores_and_matches() -> None:
    from prepkit.integrations.decode_ops import MxWeight
    from prepkit.kernels.decode.gemv_registry import TOLERANCE, norm_linear_reference, relative_error
    from prepkit.kernels.decode.variants import KERNELS, DecodeProblem

    # gpt-oss's lm_head in mxfp4 at one row, by the rule itself (no widening): the norm alone,
    # then the dense MX kernel; the GEMV is never asked.
    problem = DecodeProblem("norm_linear", 201088, 2880, 1, "mxfp4", (("normed", 1),))
    inputs = KERNELS["norm_linear"].inputs(problem, "cuda", seed=61)
    stored = inputs["weight"]
    weight = MxWeight(stored.blocks, stored.scales, "mxfp4", "bf16")
    ops = kernel_ops.KernelOps()
    got = ops.norm_linear(inputs["hidden"], inputs["add"], inputs["norm_weight"], inputs["eps"], weight, None, True)
    want = norm_linear_reference(**{**inputs, "bias": None})
    assert torch.equal(got[0], want[0])
    assert relative_error(got[1], want[1]) <= TOLERANCE and relative_error(got[2], want[2]) <= TOLERANCE
    assert not ops.chosen  # no GEMV variant was looked up


def test_kernel_ops_sample_with_the_same_seed_alike(model: torch.nn.Module) -> None:
    ids, mask = _left_padded(LENGTHS, pad_id=0)
    sampled = SamplingParams(greedy=False, temperature=0.8, top_k=8)
    length, batch = ids.shape[1] + NEW, len(LENGTHS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = PrepkitDecoder(model, length, batch_size=batch, kernels=True).generate(
            ids, NEW, attention_mask=mask, sampling=sampled, seed=3
        )
        b = PrepkitDecoder(model, length, batch_size=batch, kernels=True).generate(
            ids, NEW, attention_mask=mask, sampling=sampled, seed=3
        )
    assert torch.equal(a, b)
    assert a.shape == (batch, ids.shape[1] + NEW)


@pytest.mark.parametrize("reduce_fp32", [False, True])
def test_kernel_ops_under_a_reduce_hook_give_the_torch_steps_tokens(model: torch.nn.Module, reduce_fp32: bool) -> None:
    # Identity hooks: one rank's view of the tensor-parallel path, whose output projection runs
    # the decode kernel's projection alone (``linear``) and adds the residual after the sum. A sum
    # that takes fp32 gets the MoE's output uncast, and the next norm rounds it as it adds it.
    ids, mask = _left_padded(LENGTHS, pad_id=0)
    length, batch = ids.shape[1] + NEW, len(LENGTHS)
    seen: list[torch.dtype] = []

    def reduce(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.dtype)
        return t

    ident = {"reduce": lambda t: t, "gather": lambda t: t}
    ref = PrepkitDecoder(model, length, batch_size=batch, keep_logits=True, cuda_graph=False, **ident)
    fast = PrepkitDecoder(
        model, length, batch_size=batch, keep_logits=True, cuda_graph=False, kernels=True, reduce=reduce,
        gather=ident["gather"], reduce_fp32=reduce_fp32,
    )  # fmt: skip
    want, got = _logits_per_step(ref, ids, mask), _logits_per_step(fast, ids, mask)
    _assert_same_steps(got, want)
    # Per layer and step: o's share (bf16), then the MoE's (fp32 where the sum takes it).
    moe = torch.float32 if reduce_fp32 else torch.bfloat16
    assert seen == [torch.bfloat16, moe] * (TINY["num_layers"] * (NEW - 1))


def test_kernels_and_compile_are_one_choice(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="not both"):
        PrepkitDecoder(model, 16, compile=True, kernels=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_layer_is_at_most_eight_launches(tmp_path: Path) -> None:
    from prepkit.generation.kernel_count import count_kernels, per_layer

    # One rank, and a rank's step under an identity sum: the MoE's fp32 output handed to a sum that
    # takes fp32 costs no launch; cast to bf16 for any other sum, one a layer.
    forms: dict[str, dict] = {
        "one rank": {},
        "fp32 hand-off": {"reduce": lambda t: t, "reduce_fp32": True},
        "bf16 hand-off": {"reduce": lambda t: t, "reduce_fp32": False},
    }
    models = {layers: _model(tmp_path, "bf16", layers, device="cuda") for layers in (2, 4)}
    slopes = {}
    for form, hooks in forms.items():
        counts = {}
        for layers, model in models.items():
            decoder = PrepkitDecoder(model, 32, kernels=True, **hooks)
            decoder.generate(torch.tensor([[3, 17, 42]]), 4)
            graph = decoder.graph
            assert graph is not None
            counted = count_kernels(graph.replay, torch.device("cuda"))
            assert counted is not None
            counts[layers] = counted.kernels + counted.memory_ops
        slopes[form] = per_layer(counts)
    assert slopes["one rank"] is not None and slopes["one rank"] <= 8, slopes
    assert slopes["fp32 hand-off"] == slopes["one rank"], slopes
    assert slopes["bf16 hand-off"] == slopes["one rank"] + 1, slopes

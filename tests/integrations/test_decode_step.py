"""The decode step of :mod:`prepkit.integrations.decode_step`: its three torch ops against plain
references (sliding window, left padding, sinks), and the whole eager step against the model's
modules (the prompt's path) step for step, with bf16 and MX dense weights, left-padded rows and
sampling; its ops table and tensor-parallel hooks."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("transformers", reason="needs transformers (pip install 'prepkit-gpt-oss[test]')")

from prepkit.generation.sampling import SamplingParams  # noqa: E402
from prepkit.integrations import decode_ops as dops  # noqa: E402
from prepkit.integrations import decode_step as ds  # noqa: E402
from prepkit.integrations.static_decode import PrepkitDecoder  # noqa: E402
from prepkit.integrations.transformers import from_prepared  # noqa: E402
from prepkit.synth import write_synthetic_checkpoint  # noqa: E402

from .test_decode_rows import _left_padded  # noqa: E402
from .test_transformers import TINY, _prepare, load_reference  # noqa: E402

LENGTHS = (7, 3, 10)
SAMPLED = SamplingParams(greedy=False, temperature=1.3, top_k=5, top_p=0.9)
BF16 = torch.bfloat16


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


# --- the ops against plain references ------------------------------------------------------------


def test_norm_linear_matches_a_plain_reference() -> None:
    hidden, add = _randn(3, 64, seed=1), torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    norm_w, weight, bias = _randn(64, seed=3), _randn(40, 64, seed=4, scale=0.1), _randn(40, seed=5)
    summed, out, normed = dops.norm_linear(hidden, add, norm_w, 1e-5, weight, bias, True)
    want_summed = hidden + add.to(BF16)  # the fp32 add is rounded to bf16 before the sum
    assert torch.equal(summed, want_summed)
    x = want_summed.float()
    want_normed = (norm_w.float() * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5))).to(BF16)
    assert normed is not None and torch.allclose(normed.float(), want_normed.float(), rtol=1e-2, atol=1e-2)
    want_out = (want_normed.float() @ weight.float().T + bias.float()).to(BF16)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)
    # No add (the first layer) and no normed output unless asked for.
    first, _, none = dops.norm_linear(hidden, None, norm_w, 1e-5, weight, None, False)
    assert torch.equal(first, hidden) and none is None


def test_linear_residual_rounds_the_projection_before_the_add() -> None:
    x, weight, bias = _randn(2, 64, seed=6), _randn(48, 64, seed=7, scale=0.1), _randn(48, seed=8)
    residual = _randn(2, 48, seed=9, scale=30.0)
    got = dops.linear_residual(x, weight, bias, residual)
    proj = (x.float() @ weight.float().T + bias.float()).to(BF16)
    torch.testing.assert_close(got.float(), (residual + proj).float(), rtol=1e-2, atol=0.25)
    # With the reduction form the projection agrees to bf16 rounding as well.
    red = dops.linear_residual(x, weight, bias, residual, as_reduction=True)
    torch.testing.assert_close(red.float(), got.float(), rtol=1e-2, atol=0.25)


def _plain_rope_attend(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: int,
    pad: list[int],
    window: int | None,
    sinks: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row by row, head by head, in fp32, reading only each row's live slots: -> (output, the
    rotated key and the value written at ``position``)."""
    batch, kv_heads, _, d = keys.shape
    heads = qkv.shape[1] // d - 2 * kv_heads
    q, k, v = qkv.float().split([heads * d, kv_heads * d, kv_heads * d], dim=-1)

    def rope(x: torch.Tensor, b: int) -> torch.Tensor:
        first, second = x[..., : d // 2], x[..., d // 2 :]
        c, s = cos[b].float(), sin[b].float()
        return torch.cat([first * c - second * s, second * c + first * s], dim=-1)

    out = torch.zeros(batch, heads, d)
    new_k = torch.zeros(batch, kv_heads, d)
    for b in range(batch):
        new_k[b] = rope(k[b].view(kv_heads, d), b)
        lo = max(pad[b], position - window + 1 if window else 0)
        for h in range(heads):
            g = h // (heads // kv_heads)
            cached = torch.cat([keys[b, g, lo:position].float(), new_k[b, g, None].to(BF16).float()])
            cached_v = torch.cat([values[b, g, lo:position].float(), v[b].view(kv_heads, d)[g, None]])
            scores = cached @ rope(q[b].view(heads, d)[h], b) * scaling
            probs = torch.softmax(torch.cat([scores, sinks[h].float().view(1)]), dim=0)[:-1]
            out[b, h] = probs @ cached_v
    return out.reshape(batch, heads * d), new_k, v.view(batch, kv_heads, d)


@pytest.mark.parametrize(("window", "position", "pad"), [(None, 9, [0, 3]), (4, 11, [0, 2]), (6, 7, [5, 0])])
def test_rope_cache_attend_matches_a_plain_reference(window: int | None, position: int, pad: list[int]) -> None:
    batch, heads, kv_heads, d, length = 2, 8, 2, 16, 16
    qkv = _randn(batch, (heads + 2 * kv_heads) * d, seed=10)
    angles = torch.rand(batch, d // 2, generator=torch.Generator().manual_seed(11)) * 6
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    keys, values = _randn(batch, kv_heads, length, d, seed=12), _randn(batch, kv_heads, length, d, seed=13)
    sinks = _randn(heads, seed=14)
    want, want_k, want_v = _plain_rope_attend(qkv, cos, sin, keys, values, position, pad, window, sinks, 0.25)
    # Slots no row may read (padding, past the window, past the position) hold garbage: the op
    # must mask them, never just weigh them down.
    for b in range(batch):
        lo = max(pad[b], position - window + 1 if window else 0)
        for cache in (keys, values):
            cache[b, :, :lo] = 1e4
            cache[b, :, position + 1 :] = -1e4
    got = dops.rope_cache_attend(
        qkv, cos, sin, keys, values, torch.tensor(position), torch.tensor(pad), window, sinks, 0.25
    )
    assert got.shape == (batch, heads * d) and got.dtype == BF16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(keys[:, :, position].float(), want_k, rtol=2e-2, atol=2e-2)
    assert torch.equal(values[:, :, position].float(), want_v)


# --- the whole eager step against the model's modules ------------------------------------------


class Recording(PrepkitDecoder):
    """A decoder that keeps every step's logits (the prefill's first)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[torch.Tensor] = []

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        self.seen.append(logits.clone())
        return super()._choose(logits)


class ModulesStep(Recording):
    """The reference: each decode step through the model's modules, as the prompt runs."""

    def _step(self) -> None:
        logits = self.forward(self.next_ids, self.position.view(1))
        self.position.add_(1)
        self.next_ids.copy_(self._choose(logits)[:, None])


def _same_steps(model: torch.nn.Module, new: int, lengths: tuple[int, ...], sampling: SamplingParams) -> None:
    ids, mask = _left_padded(lengths, pad_id=0)
    batch = len(lengths)
    ref = ModulesStep(model, ids.shape[1] + new, batch_size=batch)
    step = Recording(model, ids.shape[1] + new, batch_size=batch)
    want = ref.generate(ids, new, attention_mask=mask, sampling=sampling, seed=4)
    got = step.generate(ids, new, attention_mask=mask, sampling=sampling, seed=4)
    assert torch.equal(got, want)
    assert len(step.seen) == len(ref.seen) == new
    for i, (a, b) in enumerate(zip(step.seen, ref.seen, strict=True)):
        assert torch.equal(a, b), f"step {i}"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("step") / "model", seed=31, **TINY)


@pytest.fixture(scope="module")
def bf16_model(source: Path) -> torch.nn.Module:
    model = load_reference(source)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_the_eager_step_gives_the_modules_logits_with_bf16_weights(
    bf16_model: torch.nn.Module, sampling: SamplingParams
) -> None:
    _same_steps(bf16_model, 8, LENGTHS, sampling)


@pytest.fixture(scope="module")
def mx_model(source: Path, tmp_path_factory: pytest.TempPathFactory, cpu_interpreter: None) -> torch.nn.Module:
    prepared = _prepare(source, tmp_path_factory.mktemp("step") / "mx", "--layout", "triton-moe", "--dense", "mxfp4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tuned tactic for tiny dims; the default serves
        model = from_prepared(prepared, device="cpu")
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_the_eager_step_gives_the_modules_logits_with_mx_weights(
    mx_model: torch.nn.Module, sampling: SamplingParams
) -> None:
    step = ds.step_of_model(mx_model)
    assert isinstance(step.layers[0].weights.qkv_weight, dops.MxWeight) and isinstance(step.lm_head, dops.MxWeight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same_steps(mx_model, 4, LENGTHS[:2], sampling)


# --- the ops table and the hooks -----------------------------------------------------------------


@pytest.mark.parametrize("hooked", [False, True], ids=["one-rank", "reduce-hook"])
def test_the_step_runs_the_ops_it_is_given(bf16_model: torch.nn.Module, hooked: bool) -> None:
    names = ("norm_linear", "rope_cache_attend", "linear_residual", "linear")
    calls = dict.fromkeys(names, 0)

    def counted(name: str) -> Any:
        def op(*args: Any) -> Any:
            calls[name] += 1
            return getattr(dops.TORCH_OPS, name)(*args)

        return op

    ops = dops.Ops(*(counted(name) for name in names))
    # With a reduce hook (tensor parallelism) the output projection runs alone: its residual
    # waits for the sum over the ranks.
    hooks = {"reduce": lambda t: t} if hooked else {}
    ids, mask = _left_padded(LENGTHS, pad_id=0)
    want = PrepkitDecoder(bf16_model, 20, batch_size=3).generate(ids, 4, attention_mask=mask)
    got = PrepkitDecoder(bf16_model, 20, batch_size=3, ops=ops, **hooks).generate(ids, 4, attention_mask=mask)
    assert torch.equal(got, want)
    layers, steps = TINY["num_layers"], 3  # the first new token comes from the prompt's forward
    alone = "linear" if hooked else "linear_residual"
    assert calls == {"norm_linear": steps * (2 * layers + 1), "rope_cache_attend": steps * layers,
                     "linear_residual": 0, "linear": 0, alone: steps * layers}  # fmt: skip


def test_the_hooks_see_the_projection_the_moe_and_the_logits(bf16_model: torch.nn.Module) -> None:
    seen: list[tuple[str, tuple[int, ...]]] = []

    def reduce(t: torch.Tensor) -> torch.Tensor:
        seen.append(("reduce", tuple(t.shape)))
        return t

    def gather(t: torch.Tensor) -> torch.Tensor:
        seen.append(("gather", tuple(t.shape)))
        return t

    ids, mask = _left_padded(LENGTHS, pad_id=0)
    want = PrepkitDecoder(bf16_model, 20, batch_size=3).generate(ids, 3, attention_mask=mask)
    hooked = PrepkitDecoder(bf16_model, 20, batch_size=3, reduce=reduce, gather=gather)
    # Identity hooks (one rank): the same tokens, through the unfused residual add.
    assert torch.equal(hooked.generate(ids, 3, attention_mask=mask), want)
    hidden, vocab = TINY["hidden"], TINY["vocab_size"]
    one_step = [("reduce", (3, hidden))] * (2 * TINY["num_layers"]) + [("gather", (3, vocab))]
    assert seen == one_step * 2
    # The hooks' results are what the step goes on with.
    plain = Recording(bf16_model, 20, batch_size=3)
    plain.generate(ids, 2, attention_mask=mask)
    half = Recording(bf16_model, 20, batch_size=3, reduce=lambda t: t * 0.5)
    half.generate(ids, 2, attention_mask=mask)
    assert torch.equal(half.seen[0], plain.seen[0])  # the prompt runs the modules
    assert not torch.equal(half.seen[1], plain.seen[1])


@pytest.mark.slow
def test_compiled_pieces_hold_whole_graphs_around_the_hooks(bf16_model: torch.nn.Module) -> None:
    # fullgraph=True raises on any graph break; the hooks and the MoE run between the pieces.
    ids, mask = _left_padded(LENGTHS[:2], pad_id=0)
    torch._dynamo.reset()
    step = ds.step_of_model(bf16_model, compiled=True, reduce=lambda t: t, gather=lambda t: t)
    eager = ds.step_of_model(bf16_model)
    decoder = PrepkitDecoder(bf16_model, 16, batch_size=2)
    decoder.prefill(ids, attention_mask=mask)
    keys = [k.clone() for k in decoder.keys]
    values = [v.clone() for v in decoder.values]
    args = (decoder.next_ids[:, 0], decoder.position, decoder.pad)
    got = step(*args, keys, values)
    want = eager(*args, [k.clone() for k in decoder.keys], [v.clone() for v in decoder.values])
    assert got.shape == want.shape == (2, TINY["vocab_size"])
    assert torch.allclose(got.float(), want.float(), rtol=5e-2, atol=5e-2)


def test_reductions_serve_only_the_compiled_step(bf16_model: torch.nn.Module) -> None:
    # Eagerly a reduction would materialize [B, N, K] fp32 products: the eager step keeps GEMMs.
    assert PrepkitDecoder(bf16_model, 16, projections="reduction").decode_step.ops is dops.TORCH_OPS
    assert dops.torch_ops("reduction") != dops.TORCH_OPS
    with pytest.raises(ValueError, match="projections must be"):
        PrepkitDecoder(bf16_model, 16, projections="gemm")

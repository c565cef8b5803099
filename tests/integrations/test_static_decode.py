"""PrepkitDecoder: greedy decoding on a device-side static cache, against transformers' own
``generate(do_sample=False)``. On the CPU the decode step runs eagerly (the captured step is the
same code); the GPU tests capture it in a CUDA graph and compile a decoder layer with fullgraph=True."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch

from prepkit.integrations.decode_loop import stop_at_eos  # noqa: E402
from prepkit.integrations.static_decode import PrepkitDecoder, generate_greedy  # noqa: E402
from prepkit.kernels.reference import relative_error  # noqa: E402
from prepkit.synth import write_synthetic_checkpoint  # noqa: E402

from .test_transformers import (
    REAL,
    TINY,
    _prepare,
    load_reference,
    swapped,
)

# Long enough to pass the tiny model's 128-token sliding window, so the window mask matters.
LONG = {**TINY, "num_layers": 2}
PROMPT_LEN, NEW_TOKENS = 120, 24


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("dec") / "model", seed=13, **LONG)


@pytest.fixture(scope="module")
def prepared(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _prepare(source, tmp_path_factory.mktemp("dec") / "triton", "--layout", "triton-moe")


def _prompt(length: int, batch: int = 1, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"] - 4, (batch, length), generator=g)  # no special ids


def _no_eos(model: torch.nn.Module) -> torch.nn.Module:
    # Random weights pick EOS now and then; without it both sides decode every step.
    model.generation_config.eos_token_id = None
    return model


def test_static_decode_matches_transformers_generate_past_the_window(source: Path) -> None:
    model = _no_eos(load_reference(source))
    ids = _prompt(PROMPT_LEN, batch=2)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    decoder = PrepkitDecoder(model, PROMPT_LEN + NEW_TOKENS + 8, batch_size=2)
    got = decoder.generate(ids, NEW_TOKENS)
    assert got.shape == want.shape
    assert torch.equal(got, want)
    # The same decoder again, on another prompt: the cache's old contents do not leak in.
    ids2 = _prompt(PROMPT_LEN - 30, batch=2, seed=6)
    with torch.no_grad():
        want2 = model.generate(ids2, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(decoder.generate(ids2, NEW_TOKENS), want2)


def test_without_the_window_mask_the_tokens_differ(source: Path) -> None:
    # The comparison above can fail: a decoder that ignores the sliding window decodes other logits.
    model = _no_eos(load_reference(source))
    length = 150  # past the 128-token window
    ids = _prompt(length)
    decoder = PrepkitDecoder(model, length)
    with torch.no_grad():
        want = decoder.forward(ids, decoder.kv_index[:length])
        decoder.config = copy.copy(decoder.config)
        decoder.config.sliding_window = 10**6
        got = decoder.forward(ids, decoder.kv_index[:length])
    assert not torch.equal(got, want)


def test_static_decode_with_prepkit_moe_matches_generate(source: Path, prepared: Path, cpu_interpreter: None) -> None:
    model = _no_eos(swapped(source, prepared))
    ids = _prompt(20)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(generate_greedy(model, ids, 6), want)


def test_stop_at_eos_pads_finished_rows_and_drops_done_columns() -> None:
    tokens = torch.tensor([[1, 2, 9, 5, 6, 7], [1, 2, 3, 4, 9, 8]])
    got = stop_at_eos(tokens, 2, [9], 0)
    assert torch.equal(got, torch.tensor([[1, 2, 9, 0, 0], [1, 2, 3, 4, 9]]))
    assert torch.equal(stop_at_eos(tokens, 2, [], 0), tokens)


def test_a_prompt_past_max_len_is_refused(source: Path) -> None:
    decoder = PrepkitDecoder(load_reference(source), 16)
    with pytest.raises(ValueError, match="within max_len 16"):
        decoder.generate(_prompt(10), 7)
    with pytest.raises(ValueError, match="batch 2"):
        decoder.generate(_prompt(4, batch=2), 2)


@pytest.fixture(scope="module")
def real_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    root = tmp_path_factory.mktemp("dec-real")
    src = write_synthetic_checkpoint(root / "model", seed=17, **REAL)
    prepared = _prepare(src, root / "triton", "--layout", "triton-moe")
    return _no_eos(swapped(src, prepared, "cuda"))


def _teacher_forced(decoder: PrepkitDecoder, want: torch.Tensor, prompt: int) -> list[int]:
    """Each step gets ``want``'s token as its input; returns the token each step predicts next."""
    first = decoder.generate(want[:, :prompt], 1)  # the prompt, eagerly
    assert torch.equal(first.cuda(), want[:, : prompt + 1])
    preds = []
    for i in range(prompt + 1, want.shape[1]):
        decoder.position.fill_(i - 1)
        decoder.next_ids.copy_(want[:, i - 1 : i])
        decoder.step()
        preds.append(int(decoder.next_ids[0, 0]))
    assert decoder.graph is not None
    return preds


@pytest.mark.gpu
@pytest.mark.slow
def test_graph_decode_predicts_what_transformers_predicts(real_model: torch.nn.Module) -> None:
    # Each captured step gets transformers' own greedy token as its input and must predict
    # transformers' next one; the kernel's combine adds in fp32 atomics (not bitwise
    # deterministic), so a near tie in the logits may flip, nothing else may.
    prompt, new = 40, 48
    ids = torch.randint(0, REAL["vocab_size"] - 4, (1, prompt), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        want = real_model.generate(ids, max_new_tokens=new, do_sample=False)
    decoder = PrepkitDecoder(real_model, 160)
    assert not decoder.compiled  # the default: the eager step, the modules' operations one for one
    for i, got in enumerate(_teacher_forced(decoder, want, prompt), start=prompt + 1):
        if got != int(want[0, i]):
            with torch.no_grad():
                logits = real_model(want[:, :i]).logits[0, -1].float()
            margin = float(logits[want[0, i]] - logits[got])
            assert abs(margin) <= 2e-2 * float(logits.abs().max()), (i, margin)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("projections", ["linear", "reduction"])
def test_compiled_steps_compute_the_modules_step(real_model: torch.nn.Module, projections: str) -> None:
    # Compiled steps fuse and reorder floating-point work, so their bf16 results differ in the
    # last bits; downstream, a router near tie can then pick another expert and the tokens part.
    # What must hold: the first layer's keys and values, written by each step before any expert
    # ran, agree with the modules' step to bf16 rounding.
    prompt, new = 40, 24
    ids = torch.randint(0, REAL["vocab_size"] - 4, (1, prompt), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        want = real_model.generate(ids, max_new_tokens=new, do_sample=False)
    modules = PrepkitDecoder(real_model, 80)
    _teacher_forced(modules, want, prompt)
    compiled = PrepkitDecoder(real_model, 80, compile=True, projections=projections)
    _teacher_forced(compiled, want, prompt)
    steps = slice(prompt, prompt + new - 1)
    for cache in ("keys", "values"):
        got, ref = getattr(compiled, cache)[0][:, :, steps].float(), getattr(modules, cache)[0][:, :, steps].float()
        assert relative_error(got, ref) < 1e-2, cache


@pytest.mark.gpu
@pytest.mark.slow
def test_a_decoder_layer_compiles_with_fullgraph(real_model: torch.nn.Module) -> None:
    layer = real_model.model.layers[0]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 8, REAL["hidden"], generator=g).to(torch.bfloat16).cuda()
    position_ids = torch.arange(8, device="cuda")[None]
    cos_sin = real_model.model.rotary_emb(x, position_ids)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = layer(x, attention_mask=None, position_embeddings=cos_sin, position_ids=position_ids)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True)
        got = compiled(x, attention_mask=None, position_embeddings=cos_sin, position_ids=position_ids)
    # Inductor fuses the attention's bf16 arithmetic differently, and a near tie in the router may
    # then send a token to another expert: that token differs, the others must agree.
    per_token = [relative_error(got[0, t].float(), want[0, t].float()) for t in range(got.shape[1])]
    assert sorted(per_token)[len(per_token) // 2] < 2e-2, per_token
    assert sum(e < 2e-2 for e in per_token) >= len(per_token) - 2, per_token


def test_a_decoder_layer_with_prepkit_moe_traces_whole(source: Path, prepared: Path, cpu_interpreter: None) -> None:
    # fullgraph=True fails on any graph break; aot_eager runs the traced graph (the op included) on the CPU.
    model = swapped(source, prepared)
    layer = model.model.layers[1]
    x = torch.randn(1, 6, TINY["hidden"], generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    position_ids = torch.arange(6)[None]
    cos_sin = model.model.rotary_emb(x, position_ids)
    with torch.no_grad():
        want = layer(x, attention_mask=None, position_embeddings=cos_sin, position_ids=position_ids)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        got = compiled(x, attention_mask=None, position_embeddings=cos_sin, position_ids=position_ids)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_compiled_decode_steps_give_the_eager_steps_tokens(source: Path, prepared: Path, cpu_interpreter: None) -> None:
    # The compiled pieces (prepkit.integrations.decode_step) against the same step run eagerly.
    model = _no_eos(swapped(source, prepared))
    ids = _prompt(20)
    eager = PrepkitDecoder(model, 32, compile=False)
    assert not eager.compiled
    want = eager.generate(ids, 6)
    torch._dynamo.reset()
    compiled = PrepkitDecoder(model, 32, compile=True)
    got = compiled.generate(ids, 6)
    assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want)


def test_compiling_needs_prepkit_moe_blocks(source: Path) -> None:
    model = load_reference(source)
    assert not PrepkitDecoder(model, 16).compiled  # the default: the eager step
    with pytest.raises(ValueError, match="prepkit's MoE blocks"):
        PrepkitDecoder(model, 16, compile=True)

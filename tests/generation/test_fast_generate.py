"""``model.generate`` on a ``from_prepared`` model: the fast step for the calls it supports (the
same tokens as transformers' loop on the same model, greedy), transformers' loop with one
warning for the rest; sampled calls repeat under ``torch.manual_seed``."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from prepkit.integrations.fast_generate import FallbackWarning, unsupported  # noqa: E402
from prepkit.integrations.static_decode import PrepkitDecoder  # noqa: E402
from prepkit.integrations.transformers import from_prepared  # noqa: E402

from .conftest import DEVICE  # noqa: E402


@pytest.fixture(scope="module")
def model(tiny_prepared: Path) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = from_prepared(tiny_prepared, device=DEVICE)
    m.generation_config.eos_token_id = None  # every call decodes its full length
    return m


def _ids(batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 200, (batch, length), generator=torch.Generator().manual_seed(4)).to(DEVICE)


def test_greedy_generate_takes_the_fast_step_with_transformers_tokens(model: torch.nn.Module) -> None:
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        fast = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert model._prepkit_decoders  # the call went through a decoder
    slow = type(model).generate(model, ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(fast.cpu(), slow.cpu())
    direct = PrepkitDecoder(model, 16, batch_size=2).generate(ids, 5, attention_mask=mask)
    assert torch.equal(fast.cpu(), direct)


def test_sampled_generate_repeats_under_manual_seed(model: torch.nn.Module) -> None:
    ids = _ids(1)
    kwargs = {"max_new_tokens": 6, "do_sample": True, "temperature": 2.0, "top_k": 20}
    torch.manual_seed(1)
    a = model.generate(ids, **kwargs)
    torch.manual_seed(1)
    b = model.generate(ids, **kwargs)
    outs = set()
    for seed in range(4):
        torch.manual_seed(100 + seed)
        outs.add(tuple(model.generate(ids, **kwargs)[0].tolist()))
    assert torch.equal(a, b) and len(outs) > 1


def test_a_streamer_gets_the_prompt_then_each_token(model: torch.nn.Module) -> None:
    got: list[torch.Tensor] = []

    class Streamer:
        def put(self, value: torch.Tensor) -> None:
            got.append(value)

        def end(self) -> None:
            got.append(torch.tensor([-1]))

    ids = _ids(1)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, streamer=Streamer())
    assert torch.equal(got[0], ids.cpu()) and got[-1].tolist() == [-1]
    assert torch.cat(got[1:-1]).tolist() == out[0, ids.shape[1] :].tolist()


def test_other_calls_run_transformers_loop_with_one_warning(model: torch.nn.Module) -> None:
    ids = _ids(1)
    with pytest.warns(FallbackWarning, match="repetition_penalty"):
        out = model.generate(ids, max_new_tokens=3, do_sample=False, repetition_penalty=1.3)
    want = type(model).generate(model, ids, max_new_tokens=3, do_sample=False, repetition_penalty=1.3)
    assert torch.equal(out, want)


def test_unsupported_names_the_field() -> None:
    from transformers import GenerationConfig

    assert unsupported(GenerationConfig(do_sample=True, top_p=0.9), {"attention_mask": None}) is None
    assert unsupported(GenerationConfig(num_beams=4), {}) == "num_beams=4"
    assert unsupported(GenerationConfig(), {"past_key_values": object()}) == "the argument past_key_values"


@pytest.mark.parametrize("step", ["kernels", "compiled"])
def test_the_chosen_step_is_the_one_the_decoder_runs(model: torch.nn.Module, step: str) -> None:
    from prepkit.integrations.fast_generate import enable_fast_generate

    saved = model._prepkit_step, model._prepkit_decoders, model.generate
    try:
        enable_fast_generate(model, step)  # type: ignore[arg-type]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.generate(_ids(batch=1), max_new_tokens=2, do_sample=False)
        (decoder,) = model._prepkit_decoders.values()
        assert (decoder.kernels, decoder.compiled) == (step == "kernels", step == "compiled")
    finally:
        model._prepkit_step, model._prepkit_decoders, model.generate = saved

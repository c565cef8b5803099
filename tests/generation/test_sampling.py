"""The sampler: its filters keep the tokens transformers' warpers keep, its draws follow the
filtered softmax, and a seed repeats a draw exactly."""

from __future__ import annotations

import pytest
import torch

from prepkit.errors import RecipeError
from prepkit.generation.sampling import SamplingParams, sample, uniform_noise


def _draws(logits: torch.Tensor, params: SamplingParams, count: int, seed: int = 1) -> torch.Tensor:
    return torch.stack([sample(logits, params, torch.tensor(seed), torch.tensor(p)) for p in range(count)])


def test_draws_follow_the_softmax() -> None:
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(0)) * 2
    params = SamplingParams(greedy=False, temperature=0.7, top_k=0, top_p=1.0)
    draws = _draws(logits, params, 20000)[:, 0]
    freq = torch.bincount(draws, minlength=40).float() / len(draws)
    want = (logits[0] / 0.7).softmax(-1)
    assert (freq - want).abs().max() < 0.015


def test_top_k_and_top_p_keep_what_transformers_keeps() -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)) * 3
    for top_k, top_p in ((5, 1.0), (0, 0.6), (12, 0.8)):
        params = SamplingParams(greedy=False, temperature=1.0, top_k=top_k, top_p=top_p)
        scores = logits.clone()
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        kept = torch.isfinite(scores)
        draws = _draws(logits, params, 3000)
        seen = torch.zeros_like(kept)
        for row in range(3):
            seen[row, draws[:, row].unique()] = True
        assert not (seen & ~kept).any(), (top_k, top_p)  # never a token the warpers drop
        assert seen.sum() >= kept.sum() * 0.9  # and (nearly) every kept token shows up


def test_a_seed_repeats_and_another_differs() -> None:
    logits = torch.randn(2, 1000)
    params = SamplingParams(greedy=False, top_k=50)
    assert torch.equal(_draws(logits, params, 50, seed=7), _draws(logits, params, 50, seed=7))
    assert not torch.equal(_draws(logits, params, 50, seed=7), _draws(logits, params, 50, seed=8))


def test_noise_is_uniform_and_rows_differ() -> None:
    u = uniform_noise(torch.tensor(3), torch.tensor(11), 2, 200000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.std().item() - 12**-0.5) < 0.005
    assert not torch.equal(u[0], u[1])


def test_greedy_takes_the_argmax() -> None:
    logits = torch.randn(4, 100)
    assert torch.equal(sample(logits, SamplingParams(), torch.tensor(0), torch.tensor(0)), logits.argmax(-1))


class Config:
    do_sample = True
    temperature = 0.6
    top_k = None
    top_p = 0.9


def test_params_from_a_generation_config() -> None:
    params = SamplingParams.create(defaults=Config())
    assert params == SamplingParams(greedy=False, temperature=0.6, top_k=50, top_p=0.9)
    assert SamplingParams.create(top_k=5, defaults=Config()).top_k == 5
    assert SamplingParams.create(greedy=True, defaults=Config()).greedy
    assert SamplingParams.create(temperature=0, defaults=Config()).greedy
    assert SamplingParams.create().greedy  # nothing asks to sample
    assert not SamplingParams.create(temperature=0.8).greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"top_p": 0.0}, "top-p"), ({"top_p": 1.5}, "top-p"), ({"temperature": -1.0}, "temperature"),
     ({"temperature": float("nan")}, "temperature"), ({"top_k": -3}, "top-k")],
)  # fmt: skip
def test_bad_values_are_named(kwargs: dict, field: str) -> None:
    with pytest.raises(RecipeError, match=field):
        SamplingParams.create(**kwargs)


@pytest.mark.parametrize("k", [1, 7, 50])
def test_sliced_top_k_is_top_k(k: int) -> None:
    from prepkit.generation.sampling import top_k

    scores = torch.randn(3, 50001, generator=torch.Generator().manual_seed(k))
    values, index = top_k(scores, k, chunks=16)
    want_values, want_index = scores.topk(k, dim=-1)
    assert torch.equal(values, want_values) and torch.equal(index, want_index)
    assert torch.equal(scores.gather(-1, index), values)


@pytest.mark.parametrize("vocab", [1000, 5000, 50001, 201088])
def test_sliced_argmax_is_argmax(vocab: int) -> None:
    """The two-stage argmax picks what one ``argmax`` picks: the first of tied maxima (here across
    slices too), and the first NaN when a row has one; a short row takes one stage."""
    from prepkit.generation.sampling import argmax

    g = torch.Generator().manual_seed(vocab)
    scores = torch.randn(4, vocab, generator=g).to(torch.bfloat16)
    top = scores.max() + 1
    scores[1, [vocab - 1, vocab // 2, 7]] = top  # ties in different slices: the first wins
    scores[2, [vocab - 3, 11]] = float("nan")
    scores[3] = 0.0  # all tied: index 0
    got = argmax(scores)
    assert got.dtype == torch.long
    assert torch.equal(got, scores.argmax(-1)), (got, scores.argmax(-1))
    assert got[1] == 7 and got[2] == 11 and got[3] == 0

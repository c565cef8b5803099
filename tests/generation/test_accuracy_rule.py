"""The accuracy rule (prepkit.generation.accuracy) on a tiny model: every decode path's logits,
teacher-forced, sit within 1.1x transformers' own bf16 error of an fp32 reference of the same
weights, and the rule does fail a path that computes with other weights."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from prepkit.generation import accuracy
from prepkit.generation.steps import build_decoder
from tests.integrations.test_transformers import TINY, _prepare

from .conftest import DEVICE

PROMPT, LENGTH = 8, 28


def _load(prepared: Path) -> torch.nn.Module:
    from prepkit.integrations.transformers import from_prepared

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return from_prepared(prepared, device=DEVICE)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"] - 8, (2, LENGTH), generator=torch.Generator().manual_seed(9))


@pytest.fixture(scope="module")
def yardstick(tiny_source: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, accuracy.PathAccuracy]:
    reference = accuracy.forward_logits(accuracy.reference_model(tiny_source, DEVICE, torch.float32), tokens)
    bf16 = accuracy.forward_logits(accuracy.reference_model(tiny_source, DEVICE, torch.bfloat16), tokens)
    # Positions PROMPT - 1 .. LENGTH - 2: the prompt's last, then each decode step's input.
    ref, bf16 = reference[:, PROMPT - 1 : -1], bf16[:, PROMPT - 1 : -1]
    return ref, accuracy.compare("transformers bf16", accuracy.by_position(bf16, 0), ref)


def _path(model: torch.nn.Module, tokens: torch.Tensor, ref: torch.Tensor, step: str) -> accuracy.PathAccuracy:
    decoder = build_decoder(model, LENGTH, 2, step, keep_logits=True)
    return accuracy.compare("path", accuracy.decoder_logits(decoder, tokens, PROMPT), ref)


@pytest.mark.slow
@pytest.mark.parametrize("step", ["modules", "compiled", "kernels"])
def test_decode_steps_meet_the_rule(tiny_prepared: Path, tokens: torch.Tensor, yardstick: tuple, step: str) -> None:
    ref, bf16 = yardstick
    assert 0 < bf16.mean_error < 0.05 and bf16.positions == LENGTH - PROMPT
    got = _path(_load(tiny_prepared), tokens, ref, step)
    assert got.positions == bf16.positions
    assert accuracy.passes(got, bf16), (got, bf16)
    assert got.agreement >= 0.9


@pytest.mark.slow
def test_an_mx_path_is_judged_against_its_dequantized_weights(
    tiny_source: Path, tokens: torch.Tensor, yardstick: tuple, tmp_path: Path
) -> None:
    ref, bf16 = yardstick
    prepared = _prepare(tiny_source, tmp_path / "mxfp4", "--layout", "triton-moe", "--dense", "mxfp4")
    against_source = _path(_load(prepared), tokens, ref, "modules")
    # Against the unquantized weights the rounding shows: the rule fails it.
    assert not accuracy.passes(against_source, bf16)
    dequantized = accuracy.reference_model(tiny_source, DEVICE, torch.float32, dense_from=prepared)
    own_ref = accuracy.forward_logits(dequantized, tokens)[:, PROMPT - 1 : -1]
    against_own = _path(_load(prepared), tokens, own_ref, "modules")
    # Its own reference accounts for the rounding: what is left is the activations' bf16 work (at
    # these tiny dims within 1.5x transformers' own; the rule itself holds at real dims on a GPU,
    # docs/decode.md).
    assert against_own.mean_error * 3 < against_source.mean_error
    assert accuracy.passes(against_own, bf16, factor=1.5)

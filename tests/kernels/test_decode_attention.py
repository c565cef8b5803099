"""The decode step's attention kernel (rotary, cache write, attention over the slots in use) on
tiny dims: against a fp32 torch reference and the decode step's torch path, on random data."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from prepkit.kernels.decode.attention import (
    KERNEL_NAME,
    default_variant,
    rope_cache_attend,
    variant_reason,
    workspace,
)
from prepkit.kernels.decode.attention_variants import (
    INPUT_NAMES,
    ROPE_CACHE_ATTEND,
    decode_step_attend,
    random_inputs,
    reference_attend,
)
from prepkit.kernels.decode.problems import attention_problem
from prepkit.kernels.decode.variants import KERNELS, DecodeVariant

HQ, HKV, D, L = 4, 2, 16, 40
# Relative to the largest output: the kernel's errors sit near 5e-3 (bf16 output and
# probabilities); one slot wrongly in or out of the mask, a lost sink or a missing rotary moves
# the output by 0.1 or more (test_the_tolerance_catches_a_wrong_mask_sink_or_rotary).
TOL = ROPE_CACHE_ATTEND.tolerance(attention_problem(3, HQ, HKV, D, L))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def pads_for(position: int) -> list[int]:
    """Three rows, each padded differently (the last past ``position`` when it is small)."""
    return [0, min(2, position), 5]


def make(position: int, window: int | None, device: str, seed: int = 0) -> dict[str, Any]:
    return random_inputs(3, HQ, HKV, D, L, position, pads_for(position), window, device, seed)


def copy(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def run(inputs: dict[str, Any], variant: DecodeVariant | None = None) -> torch.Tensor:
    return rope_cache_attend(**{n: inputs[n] for n in INPUT_NAMES}, variant=variant)


@pytest.mark.parametrize("position", [0, 3, 21, L - 1])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("split", [1, 4])
def test_matches_the_fp32_reference_and_the_decode_step(
    device: str, position: int, window: int | None, split: int
) -> None:
    inputs = make(position, window, device, seed=position)
    before = copy(inputs)
    ref, ref_keys, ref_values = reference_attend(before)
    step_inputs = copy(before)
    step = decode_step_attend(step_inputs)

    out = run(inputs, DecodeVariant(16, D, 4, split))

    assert out.shape == (3, HQ * D) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < TOL
    assert rel_err(out, step) < TOL
    # The written slot is the model's bit for bit; every other slot is untouched.
    for name, want in (("keys", ref_keys), ("values", ref_values)):
        got = inputs[name]
        assert torch.equal(got, want), name
        assert torch.equal(got, step_inputs[name]), name
        others = torch.arange(L, device=got.device) != position
        assert torch.equal(got[:, :, others], before[name][:, :, others]), name
        assert not torch.equal(got[:, :, position], before[name][:, :, position]), name


def test_slots_outside_the_range_in_use_are_never_read(device: str) -> None:
    position, window = 30, 8
    for split in (1, 2, 4):
        variant = DecodeVariant(16, D, 4, split)
        inputs = make(position, window, device, seed=3)
        want = run(copy(inputs), variant)
        # Huge values after the token's slot and before each row's first slot in use: were any of
        # them read, scores and values would overflow (NaN) or dominate the output.
        lo = [max(p, position - window + 1) for p in pads_for(position)]
        for cache in ("keys", "values"):
            inputs[cache][:, :, position + 1 :] = 3e38
            for row, first in enumerate(lo):
                inputs[cache][row, :, :first] = -3e38
        got = run(inputs, variant)
        assert torch.equal(got, want), f"split {split}"


def test_a_position_past_the_cache_touches_no_slot(device: str) -> None:
    """The host never reads ``position``; a bad one must not write outside the cache."""
    inputs = make(L - 1, None, device, seed=4)
    inputs["position"] = torch.tensor(L, dtype=torch.int64, device=device)
    before = copy(inputs)
    for split in (1, 2):
        run(inputs, DecodeVariant(16, D, 4, split))
        assert torch.equal(inputs["keys"], before["keys"]) and torch.equal(inputs["values"], before["values"])


def test_the_tolerance_catches_a_wrong_mask_sink_or_rotary(device: str) -> None:
    """The reference moves by more than the tolerance when the mask, the sinks or the rotary is
    wrong: a kernel making any of these mistakes fails the checks above."""
    inputs = make(25, 8, device, seed=5)
    ref = reference_attend(copy(inputs))[0]
    wider = copy(inputs)
    wider["window"] = 9
    no_pad = copy(inputs)
    no_pad["pad"] = torch.zeros_like(inputs["pad"])
    no_pad["window"] = None
    no_sink = copy(inputs)
    no_sink["sinks"] = torch.full_like(inputs["sinks"], -1e4)
    no_rotary = copy(inputs)
    no_rotary["cos"] = torch.ones_like(inputs["cos"])
    no_rotary["sin"] = torch.zeros_like(inputs["sin"])
    for label, wrong in (("window", wider), ("pad", no_pad), ("sink", no_sink), ("rotary", no_rotary)):
        assert rel_err(reference_attend(wrong)[0], ref) > 5 * TOL, label


def test_every_candidate_of_a_small_problem_matches_the_reference(device: str) -> None:
    kernel = KERNELS[KERNEL_NAME]
    assert kernel is ROPE_CACHE_ATTEND
    problem = attention_problem(3, HQ, HKV, D, slots=37, window=8, cache_len=L)
    inputs = kernel.inputs(problem, device, seed=7)
    for name in ("qkv", "keys", "values", "sinks", "cos"):
        assert (inputs[name] != 0).float().mean() > 0.9, name  # random data, not zeros
    assert int(inputs["position"]) == 36 and inputs["window"] == 8 and inputs["keys"].shape[2] == L
    ref = kernel.reference(copy(inputs))
    candidates = kernel.candidates(problem)
    assert candidates[0] == kernel.default(problem)
    assert len(set(candidates)) == len(candidates) and {v.split_k for v in candidates} >= {1, 2}
    for variant in candidates:
        assert variant_reason(variant, D) is None
        err = rel_err(kernel.launch(copy(inputs), variant), ref)
        assert err < kernel.tolerance(problem), variant.name()


def test_split_counters_are_zero_after_each_call(device: str) -> None:
    """The last split resets its counter, so a captured graph replays without a zeroing launch."""
    inputs = make(L - 1, None, device, seed=9)
    variant = DecodeVariant(16, D, 4, 2)
    first = run(copy(inputs), variant)
    counts = workspace(torch.device(device), 3 * HKV * 2, 16, D)[2]
    assert int(counts.abs().sum()) == 0
    assert torch.equal(run(copy(inputs), variant), first)


def test_default_variant_is_valid_and_splits_long_caches() -> None:
    for batch, slots in ((1, 8192), (4, 8192), (1, 40), (64, 8192)):
        v = default_variant(batch, 8, 64, slots)
        assert variant_reason(v, 64) is None
        assert batch * 8 * v.split_k <= 128 or v.split_k == 1
    # The H100 sweep's picks: eight splits of 128-slot blocks at batch 1, four at batch 4, none over a window.
    assert (default_variant(1, 8, 64, 4096).split_k, default_variant(1, 8, 64, 4096).block_n) == (8, 128)
    assert default_variant(4, 8, 64, 4096).split_k == 4
    assert default_variant(1, 8, 64, 128).split_k == 1
    assert default_variant(1, 8, 64, 40).split_k == 1 and default_variant(1, 8, 64, 40).block_n == 64


@pytest.mark.parametrize(
    ("variant", "fault"),
    [
        (DecodeVariant(8, D, 4), "block_n 8"),
        (DecodeVariant(48, D, 4), "block_n 48"),
        (DecodeVariant(16, D, 4, 32), "split 32"),
        (DecodeVariant(16, D, 3), "num_warps 3"),
        (DecodeVariant(16, 32, 4), "block_k 32"),
    ],
)
def test_variant_reason_names_the_fault(variant: DecodeVariant, fault: str) -> None:
    reason = variant_reason(variant, D)
    assert reason is not None and fault in reason


@pytest.mark.parametrize(
    ("field", "bad", "fault"),
    [
        ("keys", lambda t: t.float(), "keys:"),
        ("values", lambda t: t[:, :, :-1], "values:"),
        ("qkv", lambda t: t[:, :-D], "qkv:"),
        ("cos", lambda t: t[:, :-1], "cos:"),
        ("position", lambda t: t.reshape(1), "position:"),
        ("pad", lambda t: t.int(), "pad:"),
        ("sinks", lambda t: t[:-1], "sinks:"),
    ],
)
def test_bad_inputs_name_the_tensor(field: str, bad: Any, fault: str) -> None:
    inputs = make(5, None, "cpu")
    inputs[field] = bad(inputs[field])
    with pytest.raises(ValueError, match=fault):
        run(inputs)


def test_a_bad_window_or_variant_is_refused() -> None:
    inputs = make(5, 0, "cpu")
    with pytest.raises(ValueError, match="window: 0"):
        run(inputs)
    inputs["window"] = None
    with pytest.raises(ValueError, match="variant n8"):
        run(inputs, DecodeVariant(8, D, 4))


def test_problem_key_and_facts() -> None:
    problem = attention_problem(4, 64, 8, 64, slots=1025, window=128, cache_len=8192)
    assert problem.key() == "rope_cache_attend-r64-c1025-b4-bf16-head_dim64-kv_heads8-window128-cache_len8192"
    with pytest.raises(ValueError, match="1..8192"):
        attention_problem(4, 64, 8, 64, slots=8193, cache_len=8192)
    inputs = ROPE_CACHE_ATTEND.inputs(attention_problem(2, HQ, HKV, D, slots=20), "cpu")
    assert inputs["window"] is None and int(inputs["position"]) == 19
    assert all(0 <= p <= 19 // 4 for p in inputs["pad"].tolist())


def test_benchmark_smoke_run_on_tiny_dims(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    if device != "cpu":
        pytest.skip("a smoke check of the CPU path; the benchmark proper runs on a GPU")
    from benchmarks.bench_decode_attention import main

    argv = ["--dims", f"{HQ},{HKV},{D}", "--cache-len", str(L), "--positions", "30", "--batches", "2", "--windows", "8"]
    assert main([*argv, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["batch"], row["window"], row["position"]) == (2, 8, 30)
    assert row["read_bytes"] == 2 * 8 * HKV * D * 2 * 2  # 8 slots a row, keys and values
    assert row["err"] < TOL and row["kernel_us"] > 0 and row["torch_us"] > 0


@pytest.mark.parametrize(("capability", "on"), [((9, 0), True), ((8, 9), False)])
def test_launches_chain_on_sm90_and_newer(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], on: bool
) -> None:
    # Off the interpreter: programmatic dependent launch (kernel constant and launch option) from sm_90.
    from prepkit.kernels.decode import attention
    from prepkit.kernels.mx import _chain
    from prepkit.kernels.mx._target import pinned_capability

    launches: list[dict[str, Any]] = []

    class Recorded:
        def __getitem__(self, grid: object) -> Any:
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(attention, "_rope_cache_attend_kernel", Recorded())
    monkeypatch.setattr(_chain, "interpreting", lambda: False)
    with pinned_capability(capability):
        run(make(3, None, "cpu"))
    assert [(kw["PDL"], kw["launch_pdl"]) for kw in launches] == [(on, on)]

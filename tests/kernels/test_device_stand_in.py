"""The one device rule: a CUDA device is described by its own facts, the CPU (the Triton
interpreter) by a Hopper part's, and messages never call the interpreter a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from prepkit.kernels.device import H100, INTERPRETER, DeviceInfo
from prepkit.tactics.keys import Environment


def test_the_cpu_runs_as_a_marked_hopper_part() -> None:
    info = DeviceInfo.for_device("cpu")
    assert info is INTERPRETER and info.capability == H100.capability and info.sm_count == H100.sm_count
    assert "interpreter" in info.label and "interpreter" in Environment.of(info).label
    assert H100.label == H100.name and Environment.of(H100).label == H100.name
    # The stand-in mark changes no stored identity: rows of an H100 serve it as before.
    assert Environment.of(info).identity("x") == Environment.of(H100).identity("x")


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="old torch")
def test_a_missing_tactic_on_the_cpu_names_the_interpreter() -> None:
    from prepkit.tactics.choose import DenseCall, choose
    from prepkit.warn_once import new_owner, owned_by

    with warnings.catch_warnings(record=True) as caught, owned_by(new_owner()):
        warnings.simplefilter("always")
        choose(DenseCall(1, 128, 256, "mxfp4", None), INTERPRETER, "bf16", on_cuda=False)
    messages = [str(w.message) for w in caught]
    assert any("interpreter" in m for m in messages), messages
    assert not any("on NVIDIA H100" in m for m in messages), messages

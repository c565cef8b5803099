"""The one tactic chooser (:mod:`prepkit.tactics.choose`): the order of its steps, what each caller
gets from it, and that tactics/ depends on nothing above it."""

from __future__ import annotations

import ast
import os
import warnings
from pathlib import Path

import pytest
import torch

# Without CUDA the kernels run on the Triton interpreter, chosen when the kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import prepkit
from prepkit.kernels.device import H100
from prepkit.kernels.tactic import GemmTactic
from prepkit.kernels.variants import default_tactics, policy_variant
from prepkit.tactics import choose as choose_module
from prepkit.tactics.choose import DenseCall, MoeCall, choose
from tests.kernels.moe_data import make_layer, random_experts, random_inputs
from tests.runtime.test_dense_op import linear

ASM = GemmTactic(16, 32, 64, 4, 2, 1, "asm")


def _layer(**kwargs):  # type: ignore[no-untyped-def]
    return make_layer(random_experts(4, 64, 64, seed=5), 2, **kwargs)[0]


def test_a_partial_lookup_is_filled_by_the_default_then_mapped_and_fixed_up() -> None:
    """A lookup that answers GEMM1 only: GEMM2 is the default's; both run as the policy's variant;
    off CUDA the tuned PTX upcast becomes the integer one; the choice counts as tuned."""
    layer = _layer()
    problem = layer.problem(3)
    call = MoeCall(problem, lambda p, d: (ASM, None))
    c = choose(call, H100, "bf16", on_cuda=False)
    assert c.tuned and c.source == "lookup"
    assert c.tactics[0] == GemmTactic(16, 32, 64, 4, 2, 1, "bits")
    assert c.tactics[1] == choose_module.runnable(default_tactics(problem, H100)[1], on_cuda=False)
    on_gpu = choose(call, H100, "bf16", on_cuda=True)
    assert on_gpu.tactics[0] == ASM  # a GPU runs inline PTX
    mx = choose(call, H100, "mxfp8", on_cuda=True)
    assert mx.tactics[0] == policy_variant(ASM, "gemm1", H100, "mxfp8")


def test_the_layer_runs_a_tuned_pair_with_asm_on_the_cpu() -> None:
    """Before one chooser, a layer ran its lookup's pair as it came: inline PTX on the interpreter."""
    layer = _layer(tactic_lookup=lambda p, d: (ASM, ASM))
    assert all(t.upcast == "bits" for t in layer.tactics(3))
    x, logits = random_inputs(3, 4, 64, seed=1)
    from prepkit.runtime.moe import moe

    assert moe(layer, x, logits).shape == (3, 64)


def test_a_dense_miss_is_the_default_and_each_module_warns_once() -> None:
    """A dense lookup's ``None`` is the default; a module without a lookup warns once however many
    token counts it runs, and a second module warns again (its own warning)."""
    seen = []
    lookup_calls = []

    def lookup(*args: object) -> None:
        lookup_calls.append(args)
        return None

    assert choose(DenseCall(1, 64, 96, "mxfp4", lookup), H100, "bf16", on_cuda=True).source == "default"
    assert lookup_calls
    modules = [linear("mxfp4", 32, seed, "cpu") for seed in (1, 2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in modules:
            for tokens in (1, 3, 9):
                seen.append(m.tactic(tokens))
    assert all(t.upcast != "asm" for t in seen)  # CPU tensors: the interpreter's fix-up
    missed = [str(w.message) for w in caught if "no tuned tactic" in str(w.message)]
    assert len(missed) == 2, missed


def test_a_dense_tuned_variant_that_does_not_compile_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a MoE layer does: a tuned variant that this Triton cannot build gives way to the default
    (one warning), which serves that token count from then on."""
    from triton.runtime.errors import OutOfResources

    from prepkit.runtime import dense

    tuned = GemmTactic(16, 32, 64, 4, 2, 1, "bits")
    m = linear("mxfp4", 32, 3, "cpu", tactic_lookup=lambda *a: tuned)
    launched: list[GemmTactic] = []
    real = __import__("prepkit.kernels.mx.dense", fromlist=["launch_dense"]).launch_dense

    def fake_launch(x, weights, bias, tactic, activations, out):  # type: ignore[no-untyped-def]
        launched.append(tactic)
        if tactic == tuned:
            raise OutOfResources(300000, 101376, "shared memory")
        return real(x, weights, bias, tactic, activations, out)

    monkeypatch.setattr("prepkit.kernels.mx.dense.launch_dense", fake_launch)
    x = torch.randn((2, 96), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="do not compile with this Triton"):
        y = m(x)
    assert y.shape == (2, 32) and launched[0] == tuned and launched[1] != tuned
    assert m.tactic(2) == launched[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(x)
    assert launched[-1] == launched[1]
    assert isinstance(dense.MxLinear, type)


def test_a_new_source_is_one_entry_of_the_chooser(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source put before the default in SOURCES serves MoE layers and dense modules alike, with
    nothing else changed."""
    special = GemmTactic(32, 64, 64, 4, 2, 1, "bits")

    def team_db(call, device, activations):  # type: ignore[no-untyped-def]
        return (special, special) if isinstance(call, MoeCall) else (special,)

    monkeypatch.setattr(choose_module, "SOURCES", (("team", team_db), *choose_module.SOURCES))
    assert _layer().tactics(5) == (special, special)
    assert linear("mxfp4", 32, 1, "cpu").tactic(5) == special


def test_tactics_imports_nothing_from_the_runtime() -> None:
    """The lookup Protocols live in tactics/, so no import, typing-only ones included, goes up."""
    root = Path(prepkit.__file__).parent / "tactics"
    up = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            up += [f"{path.name}: {n}" for n in names if n.startswith(("prepkit.runtime", "prepkit.tune"))]
    assert up == []

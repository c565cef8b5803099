"""``MxLinear`` and ``torch.ops.prepkit.mx_linear``: the module against the kernel, fused q/k/v
(MX and bf16), the op's fake shapes and its opcheck, the dense tactic keys and lookup."""

from __future__ import annotations

import pytest
import torch

from prepkit.kernels.device import H100
from prepkit.kernels.tactic import GemmTactic
from prepkit.layouts import dense_mx
from prepkit.tactics.keys import dense_problem, gpt_oss_problems

K = 96


def linear(fmt: str, n: int, seed: int, device: str, bias: bool = True, **kw: object):  # type: ignore[no-untyped-def]
    from prepkit.runtime.dense import MxLinear

    g = torch.Generator().manual_seed(seed)
    st = dense_mx.to_kernel_layout(torch.randn((n, K), generator=g) * 0.05, dense_mx.mx_format(fmt))
    b = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16).to(device) if bias else None
    return MxLinear(st["blocks"].to(device), st["scales"].to(device), b, fmt, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fmt", "activations"), [("mxfp4", "bf16"), ("mxfp8", "mxfp8")])
def test_module_runs_the_kernel_and_the_op(device: str, fmt: str, activations: str) -> None:
    from prepkit.kernels.mx import mx_linear

    m = linear(fmt, 48, 0, device, activations=activations)
    assert (m.in_features, m.out_features) == (K, 48)
    x = torch.randn((2, 3, K), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
    y = m(x)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    want = mx_linear(x, m.weights(), m.bias, activations=activations, tactic=m.tactic(6))  # type: ignore[arg-type]
    assert torch.equal(y, want)
    # The op takes the weight's tensors; with no tuned rows it runs the module's variant.
    op = torch.ops.prepkit.mx_linear(x, m.weight_blocks, m.weight_scales, m.bias, fmt, activations)
    assert torch.equal(op, y)
    assert m.tactic(6) is m.tactic(6)  # chosen once per token count
    assert torch.isfinite(y).all() and y.abs().max() > 0


def test_fused_module_equals_its_parts(device: str) -> None:
    from prepkit.runtime.dense import MxLinear

    parts = [linear("mxfp4", 64, 2, device), linear("mxfp4", 32, 3, device, bias=False), linear("mxfp4", 32, 4, device)]
    fused = MxLinear.fused(parts)
    assert fused.out_features == 128 and fused.bias is not None and fused.bias.shape == (128,)
    assert torch.equal(fused.bias[64:96], torch.zeros(32, dtype=torch.bfloat16, device=device))
    x = torch.randn((3, K), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(device)
    t = GemmTactic(16, 32, 64, 4, 3, 1, "bits", "ptr")
    for m in (fused, *parts):
        m._tactics[(3, m.weight_blocks.device)] = t
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))
    with pytest.raises(ValueError, match="part 1"):
        MxLinear.fused([parts[0], linear("mxfp8", 32, 6, device)])


def test_fake_shapes_and_opcheck(device: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = linear("mxfp8", 40, 7, device)
    with FakeTensorMode():
        fx = torch.empty((5, 2, K), dtype=torch.bfloat16)
        fb, fs = (torch.empty(t.shape, dtype=t.dtype) for t in (m.weight_blocks, m.weight_scales))
        out = torch.ops.prepkit.mx_linear(fx, fb, fs, None, "mxfp8", "bf16")
        assert out.shape == (5, 2, 40) and out.dtype == torch.bfloat16
    x = torch.randn((3, K), generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).to(device)
    torch.library.opcheck(
        torch.ops.prepkit.mx_linear.default,
        (x, m.weight_blocks, m.weight_scales, m.bias, "mxfp8", "bf16"),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_module_refuses_a_policy_its_weights_cannot_run(device: str) -> None:
    with pytest.raises(ValueError, match="need mxfp4 weights"):
        linear("mxfp8", 32, 9, device, activations="mxfp4")
    m = linear("mxfp4", 32, 9, device)
    with pytest.raises(ValueError, match=r"x: shape \[2, 64\]"):
        m(torch.zeros((2, 64), dtype=torch.bfloat16, device=device))


def test_dense_keys_never_match_moe_keys() -> None:
    common = {"kernel": "moe_mxfp4", "kernel_version": "7", "weight_layout": "dense_mx_v1"}
    p4 = dense_problem(n=2880, k=2880, fmt="mxfp4", **common)
    p8 = dense_problem(n=2880, k=2880, fmt="mxfp8", **common)
    a8 = dense_problem(n=2880, k=2880, fmt="mxfp4", act_dtype="mxfp8", **common)
    moe = gpt_oss_problems(kernel="moe_mxfp4", kernel_version="7", weight_layout="dense_mx_v1")
    hashes = {p.problem_hash() for p in (p4, p8, a8, *moe.values())}
    assert len(hashes) == 5
    assert p4.role == "dense" and p4.kernel_hash() != moe["gemm2"].kernel_hash()
    assert "dense mxfp8_e4m3 N=2880 K=2880" in p8.describe()
    with pytest.raises(ValueError, match="dense weight format"):
        dense_problem(n=1, k=32, fmt="bf16", **common)


def test_dense_lookup_falls_back_to_the_default(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import warnings

    from prepkit.tactics.lookup import TacticResolver, make_dense_tactic_lookup

    res = TacticResolver(user_db=tmp_path / "none.db", bundled_db=False)
    lookup = make_dense_tactic_lookup(resolver=res, kernel_version="7")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = lookup(1, 2880, 4096, "mxfp4", "bf16", H100)
    assert t is None  # the lookup's Protocol: None means the default, which the chooser fills in
    assert any("dense mxfp4_e2m1 N=2880 K=4096" in str(w.message) for w in caught)
    from prepkit.kernels.mx.dense import default_dense_tactic
    from prepkit.tactics.choose import DenseCall, choose

    chosen = choose(DenseCall(1, 2880, 4096, "mxfp4", lookup), H100, "bf16", on_cuda=True)
    default = default_dense_tactic(1, 2880, 4096, "mxfp4", H100.capability, sm_count=H100.sm_count)
    assert chosen.tactics == (default,) and not chosen.tuned


def test_compiles_fullgraph_through_the_op(device: str) -> None:
    m = linear("mxfp4", 32, 10, device)
    x = torch.randn((4, K), generator=torch.Generator().manual_seed(11)).to(torch.bfloat16).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), m(x))


@pytest.mark.parametrize("kind", ["mx", "bf16"])
def test_fused_projections_compute_their_parts_and_share_one_copy(device: str, kind: str) -> None:
    from prepkit.runtime.dense import MxLinear, fuse_projections

    g = torch.Generator().manual_seed(12)
    if kind == "mx":
        parts: list[torch.nn.Module] = [linear("mxfp4", n, s, device) for n, s in ((64, 13), (32, 14), (32, 15))]
        t = GemmTactic(16, 32, 64, 4, 3, 1, "bits", "ptr")
        for m in parts:
            m._tactics[(3, m.weight_blocks.device)] = t  # type: ignore[index, union-attr]
        storage = "weight_blocks"
    else:
        parts = [torch.nn.Linear(K, n, dtype=torch.bfloat16, device=device) for n in (64, 32, 32)]
        storage = "weight"
    x = torch.randn((3, K), generator=g).to(torch.bfloat16).to(device)
    with torch.no_grad():
        alone = [p(x) for p in parts]
        fused = fuse_projections(parts)
        assert isinstance(fused, MxLinear if kind == "mx" else torch.nn.Linear)
        if kind == "mx":
            fused._tactics[(3, fused.weight_blocks.device)] = t  # type: ignore[index, union-attr]
        assert torch.equal(fused(x), torch.cat(alone, dim=1))
        whole = getattr(fused, storage).untyped_storage().data_ptr()
        for p, want in zip(parts, alone, strict=True):
            assert getattr(p, storage).untyped_storage().data_ptr() == whole  # a view, not a copy
            assert torch.equal(p(x), want)
        if kind == "bf16":  # fusing the views again reuses the fused tensor: no second copy
            again = fuse_projections(parts)
            assert getattr(again, storage).data_ptr() == getattr(fused, storage).data_ptr()
            assert torch.equal(again(x), torch.cat(alone, dim=1))
    with pytest.raises(ValueError, match="not all of one kind"):
        fuse_projections([linear("mxfp4", 32, 16, device), torch.nn.Linear(K, 32)])


def test_the_op_falls_back_from_a_tuned_variant_that_does_not_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor-taking op chooses through the tactic DBs per shape; a tuned variant that this
    Triton cannot build gives way to the default, for that shape from then on."""
    from triton.runtime.errors import OutOfResources

    from prepkit.runtime import dense

    tuned = GemmTactic(16, 32, 64, 4, 2, 1, "bits")
    monkeypatch.setattr(dense, "db_tactic_lookup", lambda: lambda *a: tuned)
    monkeypatch.setattr(dense, "_SHARED_CHOICES", {})
    launched: list[GemmTactic] = []
    real = __import__("prepkit.kernels.mx.dense", fromlist=["launch_dense"]).launch_dense

    def fake_launch(x, weights, bias, tactic, activations, out):  # type: ignore[no-untyped-def]
        launched.append(tactic)
        if tactic == tuned:
            raise OutOfResources(300000, 101376, "shared memory")
        return real(x, weights, bias, tactic, activations, out)

    monkeypatch.setattr("prepkit.kernels.mx.dense.launch_dense", fake_launch)
    m = linear("mxfp4", 32, 17, "cpu")
    x = torch.randn((2, K), generator=torch.Generator().manual_seed(18)).to(torch.bfloat16)
    args = (m.weight_blocks, m.weight_scales, m.bias, "mxfp4", "bf16")
    with pytest.warns(UserWarning, match="do not compile with this Triton"):
        y = torch.ops.prepkit.mx_linear(x, *args)
    assert launched[:2] == [tuned, launched[1]] and launched[1] != tuned
    assert torch.equal(torch.ops.prepkit.mx_linear(x, *args), y)
    assert launched[-1] == launched[1]  # the default serves the shape from now on

"""The torch oracle of the MoE layer, computed from the *source* checkpoint tensors.

It dequantizes the checkpoint-form experts with :mod:`prepkit.mxfp4` (never the prepared tensors),
so a kernel test compares layout + kernel together against the model's definition
(openai/gpt-oss ``gpt_oss/torch/model.py`` ``MLPBlock``; HF ``GptOssExperts``). With an
activation policy other than bf16 it applies that policy's MX quantization where the kernel does
(:mod:`prepkit.kernels.activations`): to each token row at GEMM1's input and to the SwiGLU output
at GEMM2's input, then multiplies the dequantized values. :func:`dense_reference` is the same
for one dense MX linear.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from prepkit.kernels.activations import ActivationPolicy, check_policy, fake_quantize
from prepkit.mxfp4 import dequantize

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token (largest first) and the softmax over those k logits, fp32."""
    values, ids = torch.topk(router_logits.float(), top_k, dim=-1, sorted=True)
    return ids, torch.softmax(values, dim=-1)


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT
) -> torch.Tensor:
    """gpt-oss SwiGLU: gate clamped above at ``limit``, up to ``[-limit, limit]``, and ``up + 1``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def moe_reference(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    experts: Mapping[str, torch.Tensor],
    *,
    top_k: int,
    expert_range: tuple[int, int] | None = None,
    intermediate_range: tuple[int, int] | None = None,
    apply_down_bias: bool = True,
    dtype: torch.dtype = torch.float32,
    activations: ActivationPolicy = "bf16",
) -> torch.Tensor:
    """``[T, H]`` output of one MoE layer in ``dtype`` (fp32 or fp64).

    ``experts`` holds the six checkpoint tensors of the layer for *all* experts
    (``gate_up_proj_blocks [E, 2I, H/32, 16]`` ... ``down_proj_bias [E, H]``). With
    ``expert_range``/``intermediate_range`` the result is one EP/TP rank's partial sum: only picks
    of experts in the range count, only the intermediate rows in the range, and the down bias only
    if ``apply_down_bias`` (so the ranks' outputs add up to the full layer).

    ``activations``: ``bf16`` multiplies the activations as given; ``mxfp8``/``mxfp4`` quantize
    each token row once (per 32 along H) and each pick's SwiGLU output (per 32 along this rank's
    intermediate rows, whose range starts on a group boundary) before the matmul.
    """
    check_policy(activations)
    x = fake_quantize(hidden_states.float(), activations, dtype)
    T, H = x.shape
    E = experts["gate_up_proj_blocks"].shape[0]
    I = experts["gate_up_proj_blocks"].shape[1] // 2
    e_lo, e_hi = expert_range if expert_range is not None else (0, E)
    i_lo, i_hi = intermediate_range if intermediate_range is not None else (0, I)
    ids, weights = route(router_logits, top_k)
    out = torch.zeros((T, H), dtype=dtype, device=x.device)
    for e in torch.unique(ids).tolist():
        if not e_lo <= e < e_hi:
            continue
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        w13 = dequantize(experts["gate_up_proj_blocks"][e], experts["gate_up_proj_scales"][e]).to(dtype)
        b13 = experts["gate_up_proj_bias"][e].to(dtype)
        y = x[tok] @ w13.T + b13  # [n, 2I], columns alternate gate/up
        act = fake_quantize(swiglu(y[:, 0::2], y[:, 1::2])[:, i_lo:i_hi], activations)
        w2 = dequantize(experts["down_proj_blocks"][e], experts["down_proj_scales"][e]).to(dtype)
        w2 = w2[:, i_lo:i_hi]
        z = act @ w2.T
        if apply_down_bias:
            z = z + experts["down_proj_bias"][e].to(dtype)
        out.index_add_(0, tok, z * weights[tok, slot].to(dtype)[:, None])
    return out


def dense_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activations: ActivationPolicy = "bf16",
    *,
    chunk: int = 1 << 15,
) -> torch.Tensor:
    """The dense MX linear in fp32: the policy's activations (quantized and dequantized as the
    kernel sees them) times the dequantized ``weight [N, K]`` transposed, plus ``bias``; ``chunk``
    output columns at a time, so an lm_head-sized weight never exists in fp32 at once."""
    check_policy(activations)
    xr = fake_quantize(x.float(), activations, torch.float32)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    for lo in range(0, weight.shape[0], chunk):
        out[:, lo : lo + chunk] = xr @ weight[lo : lo + chunk].float().T
    return out if bias is None else out + bias.float()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp64; NaN or inf anywhere gives ``inf`` so it never passes."""
    out64, ref64 = out.double(), ref.double()
    if not bool(torch.isfinite(out64).all()):
        return float("inf")
    denom = float(torch.linalg.vector_norm(ref64))
    return float(torch.linalg.vector_norm(out64 - ref64)) / max(denom, 1e-30)

"""How close GEMM1 comes to the streaming ceiling of its own grid.

    python -m benchmarks.bench_ceiling [--tokens 1,8,64]

For each token count it times, per MoE layer of gpt-oss-120b (CUDA graph over 16 rotated routings,
so replays read their experts from memory):

- ``stream``: a kernel with GEMM1's grid, tiles and K steps that only reads the weight bytes and
  scales (pointer loads, and TMA loads) and does no math: what this program structure can move,
  from three byte orders of the same weights:
  ``rows`` (checkpoint rows, K contiguous: the layout before triton_moe_v3),
  ``panels`` (the triton_moe_v3 K panels the kernel reads) and
  ``tiled`` (a copy stored tile by tile, each ``[block_n, block_k/2]`` step one contiguous block:
  the order no single layout can give every tile size);
- GEMM1 of the bundled kernel with pointer and with TMA weight loads, same tiles.

Each line gives µs, GB/s of weight bytes and the fraction of the device's copy bandwidth measured
in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernel import TOP_K, E, H, I, copy_bandwidth, graph_us_per_set  # noqa: E402
from prepkit.kernels import mx as k  # noqa: E402
from prepkit.kernels.mx._routing import _locate_block  # noqa: E402
from prepkit.kernels.mx._steps import _panel_step  # noqa: E402
from prepkit.kernels.tactic import GemmTactic  # noqa: E402
from prepkit.layouts.triton_moe import to_panels  # noqa: E402

TILES = ((64, 256, 3), (128, 128, 4))  # (block_n, block_k, stages), 16-row blocks, 4 warps
ORDERS = (("rows", "ptr"), ("rows", "tma"), ("panels", "ptr"), ("panels", "tma"), ("tiled", "tma"))


@triton.jit
def _stream_kernel(
    w_ptr,
    w_desc,
    s_ptr,
    counts_ptr,
    out_ptr,
    N,
    K,
    E_LOCAL,
    stride_we,
    stride_wn,
    stride_se,
    stride_sk,
    E_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_TMA: tl.constexpr,
    ORDER: tl.constexpr,
):
    """GEMM1's grid and K steps, reading weights and scales only (XOR-folded so nothing is dead).
    ORDER 0: rows ``[E, N, K/2]``; 1: panels ``[E, K/256, N, 128]``; 2: tile by tile, ``w_desc``
    describing it as ``[tiles * BLOCK_N, BLOCK_K/2]`` (TMA only)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    valid, e, _, _, _ = _locate_block(counts_ptr, pid_m, E_LOCAL, E_PAD, 16)
    if valid:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        e64 = e.to(tl.int64)
        w_ptrs = w_ptr + e64 * stride_we + offs_n[:, None] * stride_wn + tl.arange(0, BLOCK_K // 2)[None, :]
        s_ptrs = s_ptr + e64 * stride_se + tl.arange(0, BLOCK_K // 32)[None, :] * stride_sk + offs_n[:, None]
        panels = tl.cdiv(K, 256)
        w_row = (e64 * N + pid_n * BLOCK_N).to(tl.int32)
        acc = tl.zeros([BLOCK_N, BLOCK_K // 2], dtype=tl.int32)
        acc_s = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.int32)
        if ORDER == 1:
            w_row = (e64 * N * panels + pid_n * BLOCK_N).to(tl.int32)
        if ORDER == 2:
            w_row = ((e64 * (N // BLOCK_N) + pid_n) * tl.cdiv(K, BLOCK_K) * BLOCK_N).to(tl.int32)
        for k0 in range(0, K // BLOCK_K * BLOCK_K, BLOCK_K):
            if ORDER == 2:
                acc ^= w_desc.load([w_row + (k0 // BLOCK_K) * BLOCK_N, 0]).to(tl.int32)
            elif ORDER == 1:
                w_off, w_row_off, w_col = _panel_step(k0, N, 256)
                if W_TMA:
                    acc ^= w_desc.load([w_row + w_row_off, w_col]).to(tl.int32)
                else:
                    acc ^= tl.load(w_ptrs + w_off).to(tl.int32)
            elif W_TMA:
                acc ^= w_desc.load([w_row, k0 // 2]).to(tl.int32)
            else:
                acc ^= tl.load(w_ptrs + k0 // 2).to(tl.int32)
            acc_s ^= tl.load(s_ptrs).to(tl.int32)
            s_ptrs += (BLOCK_K // 32) * stride_sk
        tl.store(out_ptr + pid_m * tl.num_programs(1) + pid_n, tl.sum(tl.sum(acc, 1), 0) + tl.sum(tl.sum(acc_s, 1), 0))


def _tile_by_tile(w: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """``w [E, N, K/2]`` as ``[E, N/block_n, ceil(K/block_k), block_n, block_k/2]``, contiguous,
    the last K step zero-padded: every step of a program one contiguous block."""
    e, n, half_k = w.shape
    steps = -(-2 * half_k // block_k)
    padded = torch.nn.functional.pad(w, (0, steps * block_k // 2 - half_k))
    return padded.reshape(e, n // block_n, block_n, steps, block_k // 2).permute(0, 1, 3, 2, 4).contiguous()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,64")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n1 = 2 * I
    rows = torch.randint(0, 256, (E, n1, H // 2), generator=g, device=dev, dtype=torch.uint8)
    panels = to_panels(rows)
    s = torch.randint(119, 124, (E, H // 32, n1), generator=g, device=dev, dtype=torch.uint8)
    bias = torch.randn((E, n1), generator=g, device=dev) * 0.1
    bw = copy_bandwidth(dev)
    print(f"device: {torch.cuda.get_device_name()}; copy {bw:.0f} GB/s (read + write)")
    for T in (int(t) for t in args.tokens.split(",")):
        sets = []
        for _ in range(16):
            logits = torch.randn((T, E), generator=g, device=dev)
            x = torch.randn((T, H), generator=g, device=dev).to(torch.bfloat16)
            # The routing launch even at one token: the stream kernel reads its counters.
            sets.append((x, k.route(logits, top_k=TOP_K, expert_lo=0, num_local_experts=E, hidden=H, in_gemms=False)))
        hit = statistics.mean(int((r.counts > 0).sum()) for _, r in sets)
        print(f"T={T}: {hit:.1f} experts hit")
        for bn, bk, stages in TILES:
            full_bytes = hit * n1 * (H // bk * bk) * (1 / 2 + 1 / 32)  # what the stream kernel reads
            all_bytes = hit * n1 * H * (1 / 2 + 1 / 32)
            tiled = _tile_by_tile(rows, bn, bk)
            for order, load in ORDERS:
                tactic = GemmTactic(16, bn, bk, 4, stages, 1, "asm", load)
                w = {"rows": rows, "panels": panels, "tiled": tiled}[order]
                if order == "tiled":
                    desc = TensorDescriptor.from_tensor(tiled.view(-1, bk // 2), [bn, bk // 2])
                elif load == "tma":
                    desc = TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [bn, bk // 2])
                else:
                    desc = None
                order_id = ("rows", "panels", "tiled").index(order)

                def stream(
                    x: torch.Tensor,
                    r: k.Routing,
                    t: GemmTactic = tactic,
                    w: torch.Tensor = w,
                    desc: object = desc,
                    order_id: int = order_id,
                ) -> None:
                    grid = (k.max_row_blocks(r.num_picks, E, 16), triton.cdiv(n1, t.block_n))
                    out = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=dev)
                    _stream_kernel[grid](
                        w, w if desc is None else desc, s, r.counts, out, n1, H, E,
                        w.stride(0), 128 if order_id else w.stride(1), s.stride(0), s.stride(1),
                        E_PAD=128, BLOCK_N=t.block_n, BLOCK_K=t.block_k, W_TMA=desc is not None, ORDER=order_id,
                        num_warps=t.num_warps, num_stages=t.num_stages,
                    )  # fmt: skip

                def gemm1(x: torch.Tensor, r: k.Routing, tactic: GemmTactic = tactic) -> None:
                    k.gemm1_swiglu(r, x, panels, s, bias, valid_intermediate=I, tactic=tactic)

                steps = [("stream", stream, full_bytes)]
                if order == "panels":  # the kernel reads its own layout only
                    steps.append(("gemm1 ", gemm1, all_bytes))
                for name, step, nbytes in steps:
                    us = graph_us_per_set(step, sets, replays=15)
                    gbs = nbytes / us / 1e3
                    tile = f"n{bn} k{bk} s{stages}"
                    print(f"  {name} {order:6} {load}: {tile}: {us:8.1f} us {gbs:6.0f} GB/s {gbs / bw:6.1%} of copy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

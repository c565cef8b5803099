"""Counting a step's GPU kernels: the per-layer slope, the CPU answer, and (on a GPU) a graph's
kernels seen one by one through a replay."""

from __future__ import annotations

import pytest
import torch

from prepkit.generation.kernel_count import chain_shares, count_kernels, per_layer


def test_per_layer_is_the_slope_over_layer_counts() -> None:
    assert per_layer({2: 2 * 7 + 9, 5: 5 * 7 + 9}) == pytest.approx(7.0)
    assert per_layer({1: 1 * 4 + 3, 3: 3 * 4 + 3, 6: 6 * 4 + 3}) == pytest.approx(4.0)


def test_chain_shares_split_a_chain_of_overlapping_kernels_by_where_each_ends() -> None:
    # b starts early and waits for a (programmatic dependent launch): only its end past a counts;
    # c ends inside b (0); d follows an idle gap (its own length, the gap to no one).
    spans = [(0.0, 10.0), (2.0, 15.0), (3.0, 12.0), (20.0, 24.0)]
    assert chain_shares(spans) == [10.0, 5.0, 0.0, 4.0]
    assert sum(chain_shares(spans[:3])) == 15.0  # a chain's shares add up to its span
    assert chain_shares([]) == []


def test_one_count_gives_no_slope() -> None:
    assert per_layer({4: 40}) is None


def test_off_cuda_there_is_nothing_to_count() -> None:
    calls = []
    assert count_kernels(lambda: calls.append(1), torch.device("cpu")) is None
    assert calls == []  # nothing ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_graph_replay_shows_each_of_its_kernels() -> None:
    device = torch.device("cuda")
    a = torch.randn(256, 256, device=device)

    def body() -> None:
        b = a * 2
        c = b + 1
        torch.mm(c, c)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    counted = count_kernels(graph.replay, device)
    assert counted is not None and counted.kernels == 3
    timeline = list(zip(counted.names, counted.shares_us, strict=True))
    assert len(timeline) == 3 and all(share >= 0 for _, share in timeline) and timeline[-1][1] > 0

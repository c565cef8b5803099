"""Shared fixtures: small synthetic checkpoints with the real per-expert dims."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prepkit.layouts.base import ExpertWeights, ModelDims
from prepkit.synth import random_tensor, write_synthetic_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def synthetic_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers x 3 experts at H = I = 2880, split over 3 shards so layers straddle files."""
    return write_synthetic_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "model", num_layers=2, num_experts=3, num_shards=3, seed=1
    )


@pytest.fixture(scope="session")
def ep_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers x 4 experts at small dims, for EP splits and fast CLI runs."""
    return write_synthetic_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "small",
        num_layers=2,
        num_experts=4,
        hidden=256,
        intermediate=512,
        num_shards=2,
        seed=2,
    )


def random_experts(dims: ModelDims, seed: int = 0) -> ExpertWeights:
    """Random experts in checkpoint form: never zero, scale bytes never 0xFF."""
    return ExpertWeights.from_mapping(
        {role: random_tensor(f"x.{role}", shape, dtype, seed) for role, (shape, dtype) in dims.source_shapes().items()}
    )

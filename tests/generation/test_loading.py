"""Checks that run before any weight loads: the memory a batch needs, the context it needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prepkit.errors import DeviceError, RecipeError
from prepkit.generation import loading


def test_a_batch_too_large_for_the_gpu_is_named_before_loading(
    tiny_prepared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = loading.open_prepared(tiny_prepared)
    need = loading.check_fits(manifest, torch.device("cpu"), 4, 64)
    assert need["weights"] > 0 and need["cache"] == loading.cache_bytes(manifest.model.config, 4, 64)
    free = need["weights"] + need["headroom"] + loading.cache_bytes(manifest.model.config, 8, 64)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    loading.check_fits(manifest, torch.device("cuda"), 8, 64)  # fits exactly
    with pytest.raises(DeviceError, match=r"batch 9 x 64 tokens needs .* KV cache .* Test GPU"):
        loading.check_fits(manifest, torch.device("cuda"), 9, 64)


def test_the_context_must_hold_the_prompt_and_its_new_tokens(tiny_prepared: Path) -> None:
    manifest = loading.open_prepared(tiny_prepared)
    assert loading.check_context(manifest, 10, 5, None) == 15
    assert loading.check_context(manifest, 10, 5, 32) == 32
    with pytest.raises(RecipeError, match="--max-len is 12"):
        loading.check_context(manifest, 10, 5, 12)
    limit = int(manifest.model.config["max_position_embeddings"])
    with pytest.raises(RecipeError, match=f"context of {limit} tokens"):
        loading.check_context(manifest, limit, 1, None)


def test_a_missing_triton_names_the_extra_before_anything_loads(
    tiny_prepared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from prepkit.distribution import install_hint
    from prepkit.errors import DependencyError
    from prepkit.integrations.transformers import from_prepared

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    for call in (lambda: from_prepared(tiny_prepared, device="cpu"), loading.check_dependencies):
        with pytest.raises(DependencyError, match="triton is not installed") as caught:
            call()
        assert caught.value.hint == install_hint("gpu")

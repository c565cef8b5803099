"""``from_prepared``: transformers' gpt-oss built from a prepared shard set alone, against
transformers' own model loaded from the source checkpoint; its memory while loading; its errors.

CPU runs use the Triton interpreter at tiny dims."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks interpreter or compiler when the kernel module is imported: decide before that.
    os.environ.setdefault("TRITON_INTERPRET", "1")

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'prepkit-gpt-oss[test]')")

from safetensors.torch import load_file, save_file  # noqa: E402

from prepkit.constants import MANIFEST_NAME  # noqa: E402
from prepkit.errors import (  # noqa: E402
    DependencyError,
    DeviceError,
    LayoutError,
    PrepkitError,
    RecipeError,
    VerifyError,
)
from prepkit.fsutil import sha256_file  # noqa: E402
from prepkit.integrations.transformers import PrepkitMoeBlock, from_prepared  # noqa: E402
from prepkit.kernels.reference import relative_error  # noqa: E402
from prepkit.runtime.moe import TENSOR_NAMES  # noqa: E402
from prepkit.synth import write_synthetic_checkpoint  # noqa: E402
from tests.integrations.test_transformers import LOGITS_TOL, PROMPT, TINY, _prepare, load_reference  # noqa: E402
from tests.tokenizer_files import write_tokenizer_files  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NON_EXPERT = "rank0/non-expert-00000.safetensors"


def load(prepared: Path, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tuned tactic for tiny dims; the default serves
        return from_prepared(prepared, device=kwargs.pop("device", DEVICE), **kwargs)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = write_synthetic_checkpoint(tmp_path_factory.mktemp("fp") / "model", num_shards=2, seed=7, **TINY)
    write_tokenizer_files(src, TINY["vocab_size"])
    return src


@pytest.fixture(scope="module")
def prepared(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _prepare(source, tmp_path_factory.mktemp("fp") / "triton", "--layout", "triton-moe")


@pytest.fixture
def damaged(prepared: Path, tmp_path: Path) -> Path:
    """A copy of the prepared set to break (the rank folder's links become plain copies)."""
    return Path(shutil.copytree(prepared, tmp_path / "copy"))


@contextmanager
def moved_away(folder: Path) -> Iterator[None]:
    away = folder.rename(folder.with_name(folder.name + "-away"))
    try:
        yield
    finally:
        away.rename(folder)


@pytest.mark.slow
def test_from_prepared_matches_transformers_from_the_source(source: Path, prepared: Path, interpreter: None) -> None:
    with moved_away(source):  # the prepared set alone
        model = load(prepared)
    reference = load_reference(source, DEVICE)
    assert isinstance(model, transformers.GptOssForCausalLM) and not model.training
    assert all(isinstance(layer.mlp, PrepkitMoeBlock) for layer in model.model.layers)
    assert not any("experts" in name for name, _ in model.named_parameters())
    assert not any(type(m).__name__ == "GptOssExperts" for m in model.modules())
    # Every non-expert tensor is transformers' own, on the device, in its dtype.
    theirs = dict(reference.named_parameters())
    ours = dict(model.named_parameters())
    assert set(ours) == {n for n in theirs if ".experts." not in n}
    for name, param in ours.items():
        assert param.device.type == DEVICE and not param.requires_grad, name
        assert param.dtype == theirs[name].dtype and torch.equal(param, theirs[name]), name
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert model.model.rotary_emb.attention_scaling == reference.model.rotary_emb.attention_scaling
    assert model.generation_config.eos_token_id == reference.generation_config.eos_token_id
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(prepared))
    ids = torch.tensor(PROMPT, device=DEVICE)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "w5 w60 w7"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"].to(DEVICE)
    with torch.no_grad():
        want = reference(ids).logits.float()
        got = model(ids).logits.float()
        assert relative_error(got, want) < LOGITS_TOL
        want_tokens = reference.generate(chat, max_new_tokens=3, do_sample=False)
        got_tokens = model.generate(chat, max_new_tokens=3, do_sample=False)
    assert torch.equal(got_tokens, want_tokens)
    assert got_tokens.shape[1] == chat.shape[1] + 3


def test_non_bf16_dtype_loads_non_experts_in_it(prepared: Path, interpreter: None) -> None:
    model = load(prepared, dtype=torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {layer.mlp.moe_layer.w13_blocks.dtype for layer in model.model.layers} == {torch.uint8}
    with torch.no_grad():
        logits = model(torch.tensor(PROMPT, device=DEVICE)).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# Memory: one layer of many experts, so that a bf16 copy of the experts (4x their MXFP4 bytes)
# stands far above the loaded bytes plus one shard file.
WIDE = {"num_layers": 1, "num_experts": 64, "hidden": 512, "intermediate": 512, "top_k": 4, "vocab_size": 256}
MEMORY_SLACK = 16 * 1024**2  # interpreter-free bookkeeping: the skeleton, dicts, the tactic lookup


def _status_kib(field: str) -> int:
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert found is not None, field
    return int(found[1])


def peak_rss_growth(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the growth of the process's peak resident set while it ran, in bytes (Linux:
    the peak is reset through /proc/self/clear_refs first)."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("the peak resident set cannot be reset here (/proc/self/clear_refs)")
    start = _status_kib("VmRSS")
    result = fn()
    return result, (_status_kib("VmHWM") - start) * 1024


@pytest.mark.slow
def test_loading_holds_no_bf16_expert_copy(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interpreter: None
) -> None:
    if DEVICE != "cpu":
        pytest.skip("measures host memory with the model on the host")
    src = write_synthetic_checkpoint(tmp_path / "wide", seed=5, **WIDE)
    wide = _prepare(src, tmp_path / "wide-triton", "--layout", "triton-moe")
    E, H, I = WIDE["num_experts"], WIDE["hidden"], WIDE["intermediate"]
    bf16_experts = E * (H * 2 * I + I * H) * 2 * WIDE["num_layers"]
    # transformers' experts modules are created (the skeleton's), but only ever on the meta device.
    experts_modules: list[torch.nn.Module] = []
    experts_cls = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts
    original_init = experts_cls.__init__

    def recording_init(self: torch.nn.Module, config: Any) -> None:
        original_init(self, config)
        experts_modules.append(self)

    monkeypatch.setattr(experts_cls, "__init__", recording_init)
    load(prepared)  # first use: imports and caches, not the loader's memory
    model, growth = peak_rss_growth(lambda: load(wide))
    loaded = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        getattr(layer.mlp.moe_layer, n).nbytes for layer in model.model.layers for n in TENSOR_NAMES
    )
    largest_file = max(p.stat().st_size for p in (wide / "rank0").glob("*.safetensors"))
    bound = loaded + largest_file + MEMORY_SLACK
    assert bound < 0.75 * bf16_experts  # the bound tells a bf16 copy apart
    assert growth < bound, (growth, loaded, largest_file)
    assert experts_modules and all(p.device.type == "meta" for m in experts_modules for p in m.parameters())
    del model
    # The meter sees a bf16 copy: transformers' own load holds one.
    monkeypatch.setattr(experts_cls, "__init__", original_init)
    reference, growth = peak_rss_growth(lambda: load_reference(src))
    assert growth > bf16_experts, growth
    del reference


@pytest.mark.gpu
def test_device_memory_is_the_loaded_bytes(tmp_path: Path) -> None:
    src = write_synthetic_checkpoint(tmp_path / "wide", seed=5, **WIDE)
    wide = _prepare(src, tmp_path / "wide-triton", "--layout", "triton-moe")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = load(wide, device="cuda")
    torch.cuda.synchronize()
    loaded = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        getattr(layer.mlp.moe_layer, n).nbytes for layer in model.model.layers for n in TENSOR_NAMES
    )
    assert torch.cuda.memory_allocated() - base < loaded + 2 * 1024**2
    assert torch.cuda.max_memory_allocated() - base < loaded + 8 * 1024**2


def test_other_layouts_splits_and_ranks_are_refused(source: Path, prepared: Path, tmp_path: Path) -> None:
    gen = _prepare(source, tmp_path / "gen", "--layout", "trtllm-gen")
    with pytest.raises(LayoutError, match="'trtllm_gen_v1'.*'triton_moe_v3'"):
        load(gen)
    tp2 = _prepare(source, tmp_path / "tp2", "--layout", "triton-moe", "--tp", "2")
    with pytest.raises(LayoutError, match="tp=2 ep=1.*tp=1 ep=1"):
        load(tp2)
    ep2 = _prepare(source, tmp_path / "ep2", "--layout", "triton-moe", "--ep", "2")
    with pytest.raises(LayoutError, match="tp=1 ep=2"):
        load(ep2)
    with pytest.raises(LayoutError, match="not 1"):
        load(prepared, rank=1)


@pytest.mark.parametrize("rel", [NON_EXPERT, "rank0/experts-00001.safetensors"])
def test_a_missing_file_is_named(damaged: Path, rel: str) -> None:
    (damaged / rel).unlink()
    with pytest.raises(VerifyError, match=re.escape(str(damaged / rel)) + " is missing"):
        load(damaged)


@pytest.mark.parametrize("rel", [NON_EXPERT, "rank0/experts-00001.safetensors"])
def test_a_truncated_file_is_named(damaged: Path, rel: str) -> None:
    data = (damaged / rel).read_bytes()
    (damaged / rel).write_bytes(data[:-100])
    with pytest.raises(VerifyError, match=re.escape(str(damaged / rel)) + r" is \d+ bytes, the manifest says"):
        load(damaged)


@pytest.mark.parametrize("rel", [NON_EXPERT, "rank0/experts-00001.safetensors"])
def test_an_unreadable_file_is_named(damaged: Path, rel: str, interpreter: None) -> None:
    data = bytearray((damaged / rel).read_bytes())
    data[8:16] = b"\xff" * 8  # the JSON header is no longer JSON; the size is unchanged
    (damaged / rel).write_bytes(bytes(data))
    with pytest.raises(VerifyError, match=re.escape(str(damaged / rel)) + " cannot be read"):
        load(damaged)


def test_changed_bytes_are_found_when_hashes_are_checked(damaged: Path, interpreter: None) -> None:
    rel = "rank0/experts-00000.safetensors"
    data = bytearray((damaged / rel).read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor's bytes: the file still reads
    (damaged / rel).write_bytes(bytes(data))
    with pytest.raises(VerifyError, match=re.escape(str(damaged / rel)) + ": sha256 differs"):
        load(damaged, check_hashes=True)


def _edit_manifest(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    raw = json.loads((folder / MANIFEST_NAME).read_text())
    edit(raw)
    (folder / MANIFEST_NAME).write_text(json.dumps(raw))


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "head_dim", "model_type"])
def test_a_manifest_config_without_a_field_is_named(damaged: Path, key: str) -> None:
    _edit_manifest(damaged, lambda raw: raw["model"]["config"].pop(key))
    with pytest.raises(RecipeError, match=f"manifest.json model.config: (missing '{key}'|{key} is None)"):
        load(damaged)


def test_a_config_that_disagrees_with_the_tensors_is_named(damaged: Path, interpreter: None) -> None:
    _edit_manifest(damaged, lambda raw: raw["model"]["config"].update(vocab_size=512))
    wrong = r"(lm_head|model.embed_tokens).weight is \[256, 64\], the model config gives \[512, 64\]"
    with pytest.raises(VerifyError, match=wrong):
        load(damaged)


def test_a_tensor_the_set_lacks_is_named(damaged: Path, interpreter: None) -> None:
    tensors = load_file(str(damaged / NON_EXPERT))
    del tensors["model.norm.weight"]
    save_file(tensors, str(damaged / NON_EXPERT), metadata={"format": "pt"})
    shared = "shared/non-expert-00000.safetensors"
    shutil.copyfile(damaged / NON_EXPERT, damaged / shared)
    size, sha = (damaged / shared).stat().st_size, sha256_file(damaged / shared)
    _edit_manifest(damaged, lambda raw: raw["files"].update({shared: {"sha256": sha, "bytes": size}}))
    with pytest.raises(VerifyError, match="holds no tensor for model.norm.weight"):
        load(damaged)


def test_unsupported_transformers_is_refused(prepared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The module check_transformers_version imports (transformers may have put a new one in sys.modules).
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.55.0")
    with pytest.raises(DependencyError, match="transformers 4.55.0 is not supported"):
        load(prepared)


def test_the_cpu_needs_the_interpreter(prepared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DeviceError, match="Triton interpreter"):
        load(prepared, device="cpu")


def test_cuda_without_a_gpu_is_a_device_error(prepared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="'cuda' was asked, but torch sees no CUDA device"):
        load(prepared, device="cuda")


def test_a_rank_that_is_not_an_int_is_named(prepared: Path) -> None:
    with pytest.raises(RecipeError, match=r"rank: expected an int, got 0\.0 \(float\)"):
        load(prepared, rank=0.0)


def test_an_unknown_activation_policy_is_refused(prepared: Path) -> None:
    with pytest.raises(PrepkitError, match="fp8"):
        load(prepared, activations="fp8")

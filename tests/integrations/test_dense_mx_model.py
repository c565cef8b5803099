"""A shard set prepared with ``--dense mxfp8|mxfp4`` in transformers: ``from_prepared`` swaps the
q/k/v/o projections and lm_head for MX linears, and the model computes what transformers' own
computes with those weights dequantized. CPU runs use the Triton interpreter at tiny dims."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'prepkit-gpt-oss[test]')")

from prepkit.constants import MANIFEST_NAME  # noqa: E402
from prepkit.errors import VerifyError  # noqa: E402
from prepkit.integrations.static_decode import PrepkitDecoder  # noqa: E402
from prepkit.integrations.transformers import from_prepared  # noqa: E402
from prepkit.kernels.reference import relative_error  # noqa: E402
from prepkit.layouts import dense_mx  # noqa: E402
from prepkit.runtime.dense import MxLinear, db_tactic_lookup  # noqa: E402
from prepkit.synth import write_synthetic_checkpoint  # noqa: E402
from tests.integrations.test_transformers import (  # noqa: E402
    LOGITS_TOL,
    PROMPT,
    TINY,
    _prepare,
    load_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DENSE = ("q_proj", "k_proj", "v_proj", "o_proj")


def load(prepared: Path, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tuned tactic for tiny dims; the default serves
        return from_prepared(prepared, device=DEVICE, **kwargs)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("mx") / "model", seed=11, **TINY)


@pytest.fixture(scope="module", params=["mxfp4", "mxfp8"])
def prepared(request: pytest.FixtureRequest, source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mx") / request.param
    return _prepare(source, out, "--layout", "triton-moe", "--dense", request.param)


def dequantized_reference(source: Path, prepared: Path) -> Any:
    """transformers' model from the source, its dense weights replaced by what the prepared set's
    MX tensors encode."""
    from safetensors import safe_open

    fmt = dense_mx.mx_format(json.loads((prepared / MANIFEST_NAME).read_text())["dense"]["format"])
    model = load_reference(source, DEVICE)
    for path in sorted((prepared / "shared").glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name.endswith(dense_mx.BLOCKS_SUFFIX):
                    weight = name[: -len(dense_mx.BLOCKS_SUFFIX)]
                    w = dense_mx.dequantize_kernel_layout(
                        f.get_tensor(name), f.get_tensor(weight + dense_mx.SCALES_SUFFIX), fmt
                    )
                    model.get_parameter(weight).data.copy_(w.to(torch.bfloat16))
    return model


def test_mx_dense_weights_run_as_mx_linears(source: Path, prepared: Path, interpreter: None) -> None:
    model = load(prepared)
    reference = dequantized_reference(source, prepared)
    assert isinstance(model.lm_head, MxLinear)
    assert model.lm_head.tactic_lookup is db_tactic_lookup()  # tuned rows serve every path
    for layer in model.model.layers:
        attn = layer.self_attn
        assert all(isinstance(getattr(attn, name), MxLinear) for name in DENSE)
        # q, k and v view the fused module's buffers: one copy of their weights.
        fused = attn.qkv_proj.weight_blocks
        for name in ("q_proj", "k_proj", "v_proj"):
            blocks = getattr(attn, name).weight_blocks
            assert blocks.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr(), name
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith(("q_proj.weight", "o_proj.weight")) or n == "lm_head.weight" for n in names)
    ids = torch.tensor(PROMPT, device=DEVICE)
    with torch.no_grad():
        got, want = model(ids).logits.float(), reference(ids).logits.float()
        assert relative_error(got, want) < LOGITS_TOL
        model.generation_config.eos_token_id = reference.generation_config.eos_token_id = None
        want_tokens = reference.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want_tokens)
        # The decode step runs q/k/v as one launch (qkv_proj) and gives generate's tokens.
        assert torch.equal(PrepkitDecoder(model, 16).generate(ids, 4).to(want_tokens.device), want_tokens)


def test_mx_dense_changes_the_logits_less_than_its_bound(source: Path, prepared: Path, interpreter: None) -> None:
    # The swap is real: against transformers' bf16 weights the logits move, mxfp4 more than mxfp8.
    model = load(prepared)
    bf16 = load_reference(source, DEVICE)
    ids = torch.tensor(PROMPT, device=DEVICE)
    with torch.no_grad():
        err = relative_error(model(ids).logits.float(), bf16(ids).logits.float())
    assert 1e-4 < err < 0.5


@pytest.mark.slow
def test_compiled_steps_with_mx_dense_give_the_modules_tokens(prepared: Path, interpreter: None) -> None:
    model = load(prepared)
    model.generation_config.eos_token_id = None
    ids = torch.tensor(PROMPT)
    want = PrepkitDecoder(model, 16).generate(ids, 4)
    torch._dynamo.reset()
    assert torch.equal(PrepkitDecoder(model, 16, compile=True).generate(ids, 4), want)


def test_a_manifest_that_disagrees_with_the_files_is_named(source: Path, prepared: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(prepared, tmp_path / "copy"))
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest.pop("dense")
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(VerifyError, match="records bf16 dense weights"):
        load(copy)


def test_use_prepkit_moe_swaps_in_the_mx_dense_weights_too(source: Path, prepared: Path, interpreter: None) -> None:
    from prepkit.integrations.transformers import use_prepkit_moe

    model = load_reference(source, DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        use_prepkit_moe(model, prepared)
    assert isinstance(model.lm_head, MxLinear)
    assert all(isinstance(getattr(layer.self_attn, n), MxLinear) for layer in model.model.layers for n in DENSE)
    ids = torch.tensor(PROMPT, device=DEVICE)
    with torch.no_grad():
        got = model(ids).logits.float()
        want = load(prepared)(ids).logits.float()
    assert relative_error(got, want) < 1e-3  # the same kernels on the same weights

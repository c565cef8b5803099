"""The accuracy rule for fast decode paths, measured rather than assumed.

Every path is compared with an fp32 reference of the same weights (transformers' own model in
fp32, the MXFP4 experts dequantized exactly; for ``--dense mxfp8|mxfp4`` sets, the dense weights
replaced by the values their MX codes decode to). On one random token sequence, each path's
logits at every position (teacher-forced: each step gets the sequence's own next token) are set
against the reference's:

- the relative error ``||path - ref|| / ||ref||`` per position, averaged;
- greedy agreement: how often the path's argmax is the reference's.

Transformers' own bf16 eager forward is the yardstick: a fast path is correct when its mean error
is within :data:`ERROR_FACTOR` times transformers' own. The rule lets a path round differently
from transformers, but never by more than transformers' bf16 itself deviates from exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from prepkit.kernels.reference import relative_error

ERROR_FACTOR = 1.1


@dataclass(frozen=True)
class PathAccuracy:
    """One path's logits against the reference over ``positions`` teacher-forced positions."""

    path: str
    mean_error: float
    max_error: float
    agreement: float
    positions: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def passes(path: PathAccuracy, transformers_bf16: PathAccuracy, factor: float = ERROR_FACTOR) -> bool:
    """Whether ``path`` meets the rule against transformers' own bf16 error."""
    return path.mean_error <= factor * transformers_bf16.mean_error


def compare(name: str, logits: Iterator[torch.Tensor], reference: torch.Tensor) -> PathAccuracy:
    """``logits`` yields ``[B, V]`` for positions ``0, 1, ...`` of ``reference`` ``[B, L, V]``."""
    errors, agree, count = [], 0, 0
    for position, got in enumerate(logits):
        ref = reference[:, position].float()
        got = got.float().to(ref.device)
        errors.append(relative_error(got, ref))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        count += got.shape[0]
    return PathAccuracy(name, sum(errors) / len(errors), max(errors), agree / max(count, 1), len(errors))


@torch.no_grad()
def forward_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, L, V]`` logits of one cache-free forward over ``tokens`` (fp32 on the model's device)."""
    device = model.model.embed_tokens.weight.device
    return model(tokens.to(device), use_cache=False).logits.float()


def by_position(logits: torch.Tensor, start: int) -> Iterator[torch.Tensor]:
    """``logits`` ``[B, L, V]`` as positions ``start, start + 1, ...``."""
    for position in range(start, logits.shape[1]):
        yield logits[:, position]


@torch.no_grad()
def decoder_logits(decoder: Any, tokens: torch.Tensor, prompt: int) -> Iterator[torch.Tensor]:
    """Teacher-forced logits of a :class:`~prepkit.integrations.static_decode.PrepkitDecoder`
    (built with ``keep_logits=True``): the prompt's last position, then one decode step per
    following token of ``tokens`` ``[B, L]``, each step given the sequence's own token. Yields
    positions ``prompt - 1`` to ``L - 2``."""
    device = decoder.device
    decoder.prefill(tokens[:, :prompt])
    yield decoder.logits.clone()
    for position in range(prompt, tokens.shape[1] - 1):
        decoder.position.fill_(position)
        decoder.next_ids.copy_(tokens[:, position : position + 1].to(device))
        decoder.step()
        yield decoder.logits.clone()


def reference_model(
    source: Path, device: str | torch.device, dtype: torch.dtype, dense_from: Path | None = None
) -> Any:
    """transformers' model of the ``source`` checkpoint in ``dtype`` (experts dequantized from
    MXFP4, exact); with ``dense_from`` (a ``--dense mxfp8|mxfp4`` prepared folder), its dense
    weights replaced by the values the folder's MX codes decode to."""
    import warnings

    from transformers import AutoModelForCausalLM, Mxfp4Config  # type: ignore[attr-defined]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(source), quantization_config=Mxfp4Config(dequantize=True), dtype=dtype
        )
    model = model.to(device)  # device_map would need accelerate
    model.generation_config.eos_token_id = None
    if dense_from is not None:
        load_dequantized_dense(model, dense_from)
    return model.eval()


def load_dequantized_dense(model: Any, prepared: Path) -> int:
    """Overwrite each dense weight of ``model`` with the dequantized MX values ``prepared``
    stores for it; returns how many were replaced."""
    from prepkit.integrations.dense_swap import read_mx_parts
    from prepkit.layouts.dense_mx import dequantize_kernel_layout, mx_format
    from prepkit.manifest import Manifest

    manifest = Manifest.read(prepared)
    fmt = mx_format(manifest.dense_format)
    parts = read_mx_parts(prepared, manifest.rank_shared_files(0), torch.device("cpu"))
    for name, stored in parts.items():
        weight = model.get_parameter(name)
        values = dequantize_kernel_layout(stored["blocks"], stored["scales"], fmt, name)
        with torch.no_grad():
            weight.copy_(values.to(weight.dtype))
    return len(parts)

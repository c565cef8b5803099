"""How the decode step (:mod:`prepkit.integrations.decode_step`) runs, and which one a device gets
by default:

- ``"modules"``: eagerly, the model's modules' operations one for one (replayed in a CUDA graph
  on a GPU);
- ``"compiled"``: through ``torch.compile`` (the work between matrix products fused);
- ``"kernels"``: prepkit's decode kernels, one launch per op (norm and q/k/v; rotary, cache write
  and attention over the slots in use; output projection and residual; norm and router).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch

DecodeStep = Literal["modules", "compiled", "kernels"]
DECODE_STEPS: tuple[DecodeStep, ...] = get_args(DecodeStep)


def default_step(device: torch.device, batch: int = 1) -> DecodeStep:
    """The fastest step that passes the accuracy rule (docs/decode.md) for ``batch`` rows: on a
    GPU the kernels at one row (faster per layer than the compiled step at gpt-oss-120b dims) and
    the compiled step for more rows, where the decode projections fall behind the library GEMMs;
    the modules on the CPU, where compiling costs more than it saves."""
    if device.type != "cuda":
        return "modules"
    return "kernels" if batch == 1 else "compiled"


def build_decoder(model: Any, max_len: int, batch: int, step: DecodeStep, **options: Any) -> Any:
    """A :class:`~prepkit.integrations.static_decode.PrepkitDecoder` for ``batch`` rows of
    ``max_len`` tokens running ``step``; ``options``: the decoder's other arguments (``reduce``/
    ``gather`` hooks, ``eos_ids``, ``pad_id``, ``keep_logits``)."""
    from prepkit.integrations.static_decode import PrepkitDecoder

    return PrepkitDecoder(
        model, max_len, batch_size=batch, compile=step == "compiled", kernels=step == "kernels", **options
    )

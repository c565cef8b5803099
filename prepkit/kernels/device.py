"""Device facts that kernel heuristics read, and what Triton makes of a device.

Heuristics take a ``DeviceInfo``; only :meth:`DeviceInfo.from_torch` talks to the driver (the
tactics key's ``Environment`` is built from it), so tests can describe any GPU on a CPU.
:func:`lowers_natively` is the one rule for whether MX operands reach block-scaled MMA.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class DeviceInfo:
    """What variant pruning and defaults need to know about one GPU."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    max_shared_mem: int  # bytes one block may use (opt-in limit)
    l2_bytes: int = 50 * 2**20
    registers_per_sm: int = 65536
    # DRAM bandwidth (bytes/s, from the data sheet; 0 when unknown: the driver does not report it).
    dram_bytes_per_s: float = 0.0
    mem_bytes: int = 0  # device memory (0 for the reference devices: not a heuristic input)
    # True for the CPU's stand-in: kernels run on the Triton interpreter, sized as for this part.
    stand_in: bool = False

    @property
    def label(self) -> str:
        """How messages name the device: the CPU's interpreter is not called a GPU."""
        return f"the CPU's Triton interpreter (sized as an {self.name})" if self.stand_in else self.name

    @classmethod
    def for_device(cls, device: Any) -> DeviceInfo:
        """The facts kernels are chosen by on ``device``: the CUDA device's own, or on the CPU (the
        Triton interpreter) :data:`INTERPRETER`, a Hopper part's. The one place that decides."""
        import torch

        target = torch.device(device)
        return cls.from_torch(target) if target.type == "cuda" else INTERPRETER

    @classmethod
    def from_torch(cls, device: Any = None) -> DeviceInfo:
        """Read the facts of a CUDA device (the only place that queries the driver)."""
        import torch

        dev = torch.device("cuda" if device is None else device)
        props = torch.cuda.get_device_properties(dev)
        # Hopper and Blackwell expose 227 KiB per block, Ada/consumer Blackwell about 99 KiB.
        smem = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
        if not smem:
            smem = 232448 if props.major in (9, 10) else 101376
        return cls(
            name=props.name,
            capability=(props.major, props.minor),
            sm_count=props.multi_processor_count,
            max_shared_mem=smem,
            l2_bytes=int(getattr(props, "L2_cache_size", 50 * 2**20)),
            registers_per_sm=int(getattr(props, "regs_per_multiprocessor", 65536) or 65536),
            mem_bytes=int(props.total_memory),
        )


# Reference devices for tests, CPU runs and docs.
H100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 50 * 2**20, dram_bytes_per_s=3.35e12)
H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 232448, 60 * 2**20, dram_bytes_per_s=4.8e12)
RTX_PRO_6000 = DeviceInfo("NVIDIA RTX PRO 6000 Blackwell", (12, 0), 188, 101376, 128 * 2**20, dram_bytes_per_s=1.79e12)
GB10 = DeviceInfo("NVIDIA GB10", (12, 1), 48, 101376, 24 * 2**20, dram_bytes_per_s=273e9)
# What the CPU runs kernels as: an H100's facts, marked as a stand-in.
INTERPRETER = replace(H100, stand_in=True)

# The reference device of each architecture a compile-only check targets (prepkit.kernels.compile_check).
ARCH_DEVICES: dict[str, DeviceInfo] = {"sm90": H100, "sm120": RTX_PRO_6000, "sm121": GB10}


# The oldest Triton whose sm_120 / sm_121 lowering of same-format MX ``tl.dot_scaled`` to the
# block-scaled ``mma.sync`` has been checked (docs/sm12x.md).
NATIVE_MX_TRITON_SM12X = (3, 6)


@functools.cache
def lowers_natively(capability: tuple[int, int], triton_version: str | None = None) -> bool:
    """Whether Triton lowers same-format MX ``tl.dot_scaled`` to block-scaled MMA on a GPU of
    this compute capability (SM10x: tcgen05; SM12x: ``mma.sync ... block_scale``, from Triton
    3.6). Elsewhere (Hopper and older) it upcasts to bf16 first. ``triton_version``: the
    installed one by default. Cached: MX layers ask on every call."""
    if capability[0] not in (10, 12):
        return False
    import triton
    import triton.language as tl

    if not hasattr(tl, "dot_scaled"):
        return False
    if capability[0] == 12:
        found = re.match(r"(\d+)\.(\d+)", triton_version or triton.__version__)
        return found is not None and (int(found[1]), int(found[2])) >= NATIVE_MX_TRITON_SM12X
    return True

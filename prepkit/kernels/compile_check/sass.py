"""Reading what the compiler made: the matrix instruction in the PTX, and the K loop of the SASS
listing (``cuobjdump`` / ``nvdisasm`` as the triton wheel ships them)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

from prepkit.errors import DeviceError

# The matrix instruction a kernel's PTX uses, most specific first: (label, regex on the PTX).
_MMA_KINDS: tuple[tuple[str, str], ...] = (
    ("block_scale mxf8f6f4", r"mma\.sync\.aligned\.\S*kind::mxf8f6f4\.block_scale\S*"),
    ("block_scale mxf4nvf4", r"mma\.sync\.aligned\.\S*kind::mxf4nvf4\.block_scale\S*"),
    ("block_scale mxf4", r"mma\.sync\.aligned\.\S*kind::mxf4\.block_scale\S*"),
    ("wgmma", r"wgmma\.mma_async\S*"),
    ("tcgen05", r"tcgen05\.mma\S*"),
    ("mma.sync bf16", r"mma\.sync\.aligned\.\S*\.bf16\.bf16\S*"),
    ("mma.sync fp16", r"mma\.sync\.aligned\.\S*\.f16\.f16\S*"),
    ("mma.sync", r"mma\.sync\.aligned\.\S*"),
)


class NvidiaTools:
    """``cuobjdump`` and ``nvdisasm`` as shipped in the triton wheel (or named by Triton's knobs)."""

    def __init__(self) -> None:
        from triton import knobs

        # Found up front (each answers --version): a missing tool is one clear error, not a
        # failure of every variant.
        found = {}
        for name in ("ptxas", "ptxas-blackwell", "cuobjdump", "nvdisasm"):
            knob = name.replace("-", "_")
            if not hasattr(knobs.nvidia, knob):
                continue  # ptxas-blackwell is a newer triton's second ptxas (sm_90 and up)
            try:
                found[name] = getattr(knobs.nvidia, knob).path
            except RuntimeError as exc:
                env = f"TRITON_{name.upper().replace('-', '_')}_PATH"
                raise DeviceError(
                    f"the compile check needs {name}: {exc}",
                    hint=f"the triton wheel ships it under triton/backends/nvidia/bin; or set {env}",
                ) from None
        self.cuobjdump = found["cuobjdump"]
        self.nvdisasm = found["nvdisasm"]

    def inspect(self, cubin: bytes) -> tuple[dict[str, int], str]:
        """(resource usage fields, SASS listing) of one cubin."""
        with tempfile.TemporaryDirectory(prefix="prepkit-compile-") as tmp:
            path = os.path.join(tmp, "kernel.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            usage = subprocess.run(
                [self.cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True, check=True
            ).stdout
            sass = subprocess.run([self.nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
        fields = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
        return fields, sass


def mma_kind(ptx: str) -> tuple[str, str]:
    """(label, first instruction) of the matrix instruction in ``ptx``; ``("", "")`` if none."""
    for label, pattern in _MMA_KINDS:
        m = re.search(pattern, ptx)
        if m:
            return label, m.group(0).rstrip(";,")
    return "", ""


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA(?:\.[A-Z]+)*\s+(?:[!A-Z0-9]+,\s*)?`\((\.L_x_\d+)\)")
_SASS_MMA = re.compile(r"^(?:@!?U?P\w+\s+)?[A-Z]*MMA\b")
_SASS_STORE = re.compile(r"^(?:@!?U?P\w+\s+)?(?:STG|RED|ATOM)\b")


def k_loop(sass: str) -> tuple[int, int] | None:
    """(instructions, matrix instructions) in the body of the K loop of an ``nvdisasm -c``
    listing: of the loops closed by a backward branch, the innermost one holding matrix
    instructions. ``None`` when no loop holds one."""
    loops = [(len(body), mma) for body in _loops(sass) if (mma := sum(1 for t in body if _SASS_MMA.match(t)))]
    return min(loops) if loops else None


def stream_loop(sass: str) -> int | None:
    """Instructions in the body of the K loop of a kernel without matrix instructions (the decode
    projections): the longest loop closed by a backward branch that stores nothing to global
    memory (the row loops of a prologue or epilogue store, or are shorter). ``None`` without one."""
    loops = [len(body) for body in _loops(sass) if not any(_SASS_STORE.match(t) for t in body)]
    return max(loops) if loops else None


def _loops(sass: str) -> list[list[str]]:
    """The instruction texts of each loop closed by a backward branch in an ``nvdisasm -c`` listing."""
    addr_of: dict[str, int] = {}
    pending: list[str] = []
    instructions: list[tuple[int, str]] = []
    for line in sass.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _SASS_LINE.match(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                addr_of[name] = addr
            pending.clear()
            instructions.append((addr, m.group(2)))
    loops = []
    for addr, text in instructions:
        b = _SASS_BRANCH.search(text)
        if b and b.group(1) in addr_of and addr_of[b.group(1)] < addr:
            loops.append([t for a, t in instructions if addr_of[b.group(1)] <= a <= addr])
    return loops

"""What a tactic row is keyed by: the GEMM problem, the environment it was measured on, the
tactic itself, and the canonical JSON hashes that make rows of two DBs merge without renumbering.

Standard library only (``torch``/``triton`` lazily in :meth:`Environment.current`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from prepkit.mx_formats import MX_FORMATS

if TYPE_CHECKING:
    from prepkit.kernels.activations import ActivationPolicy
    from prepkit.layer import RankLayer

# The kernel whose variants the DB holds, by name (prepkit.kernels.moe_mxfp4).
KERNEL_NAME = "moe_mxfp4"
# gate/up + SwiGLU, or down + routed sum; "dense" is the dense MX linear (one group, no routing),
# a kind of its own so that a lookup never crosses MoE and dense rows.
Role = Literal["gemm1", "gemm2", "dense"]
ROLES: tuple[Role, Role] = ("gemm1", "gemm2")  # the MoE layer's
DENSE_ROLE: Role = "dense"
# Each dense weight format's w_dtype in a problem key (the MoE weights are "mxfp4_e2m1").
DENSE_W_DTYPES = {f.name: f.w_dtype for f in MX_FORMATS.values()}


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no spaces: the form that is hashed and stored."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def digest(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:32]


class JsonTactic(Protocol):
    """A tactic object that writes its own JSON (the kernels' ``GemmTactic``)."""

    def to_json(self) -> str: ...


def canon(tactic: str | Mapping[str, Any] | JsonTactic) -> str:
    """Canonical JSON of a tactic given as JSON text, a mapping, or an object with ``to_json``."""
    if isinstance(tactic, str):
        return canonical_json(json.loads(tactic))
    if isinstance(tactic, Mapping):
        return canonical_json(dict(tactic))
    return canonical_json(json.loads(tactic.to_json()))


def tactic_hash(params_json: str) -> str:
    """Hash of a tactic's JSON, independent of key order and spacing."""
    return digest(json.loads(params_json))


def arch_name(cc_major: int, cc_minor: int) -> str:
    """``(9, 0)`` -> ``'sm90'``, ``(12, 1)`` -> ``'sm121'``."""
    return f"sm{cc_major}{cc_minor}"


def triton_minor(version: str) -> str:
    """``'3.6.0'`` -> ``'3.6'``; an empty or odd string stays as it is."""
    parts = version.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else version


# Every field of ProblemKey except tp_size/ep_size enters problem_hash() through shape_fields(),
# and the hashes are the rows' keys in every tactics DB: a new field (even one with a default), a
# renamed one or another value spelling changes every problem hash and orphans every stored row.
# tests/test_tactics_db.py pins today's hashes of real problems.
@dataclass(frozen=True)
class ProblemKey:
    """Everything that changes the math or the best variant of one GEMM, except the token count.

    ``n``/``k`` are per-rank sizes as the checkpoint has them (before the layout pads them); the
    layout id covers the padding. ``act_dtype`` is the activation precision policy (``bf16``,
    ``mxfp8``, ``mxfp4``): a lookup never crosses it. ``tp_size``/``ep_size`` are stored for
    people, not matched. The kernel fields are part of the key: a new kernel version or layout
    never matches rows measured for an old one.
    """

    kernel: str
    kernel_version: str
    weight_layout: str
    role: Role
    num_experts: int  # local experts on this rank
    top_k: int
    n: int
    k: int
    act_dtype: ActivationPolicy = "bf16"
    w_dtype: str = "mxfp4_e2m1"
    out_dtype: str = "bf16"
    activation: str = "none"
    tp_size: int = 1
    ep_size: int = 1

    def kernel_fields(self) -> dict[str, str]:
        return {
            "name": self.kernel,
            "role": self.role,
            "kernel_version": str(self.kernel_version),
            "weight_layout": self.weight_layout,
        }

    def kernel_hash(self) -> str:
        return digest(self.kernel_fields())

    @classmethod
    def shape_field_names(cls) -> tuple[str, ...]:
        """The fields :meth:`shape_fields` holds (the problem table's columns)."""
        return tuple(f.name for f in fields(cls) if f.name not in ("kernel", "kernel_version", "weight_layout", "role"))

    def shape_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.shape_field_names()}

    def problem_hash(self) -> str:
        # tp/ep are recorded but not hashed: the kernel sees only per-rank sizes (n, k, local
        # experts), and the runtime knows nothing else about the rank.
        fields = {k: v for k, v in self.shape_fields().items() if k not in ("tp_size", "ep_size")}
        return digest({"kernel": self.kernel_hash(), **fields})

    def describe(self) -> str:
        acts = "" if self.act_dtype == "bf16" else f" act={self.act_dtype}"
        if self.role == DENSE_ROLE:
            return (
                f"dense {self.w_dtype} N={self.n} K={self.k}{acts} "
                f"({self.kernel} v{self.kernel_version}, layout {self.weight_layout})"
            )
        return (
            f"{self.role} E={self.num_experts} top_k={self.top_k} N={self.n} K={self.k}{acts} "
            f"tp={self.tp_size} ({self.kernel} v{self.kernel_version}, layout {self.weight_layout})"
        )

    @property
    def layer_dims(self) -> tuple[int, int]:
        """``(hidden, valid intermediate)`` of the layer this GEMM belongs to."""
        if self.role == "gemm1":
            return self.k, self.n // 2
        return self.n, self.k


def gpt_oss_problems(
    *,
    kernel: str,
    kernel_version: str,
    weight_layout: str,
    num_experts: int = 128,
    hidden: int = 2880,
    intermediate: int = 2880,
    top_k: int = 4,
    tp_size: int = 1,
    ep_size: int = 1,
    act_dtype: ActivationPolicy = "bf16",
) -> dict[str, ProblemKey]:
    """The two GEMM problems of one gpt-oss MoE layer on one rank, keyed by role. The dims are the
    rank's own: ``num_experts`` its local experts, ``intermediate`` its valid intermediate rows
    (``tp_size``/``ep_size`` are recorded only)."""

    def key(role: Role, n: int, k: int, activation: str) -> ProblemKey:
        return ProblemKey(
            kernel=kernel, kernel_version=str(kernel_version), weight_layout=weight_layout, role=role,
            num_experts=num_experts, top_k=top_k, n=n, k=k, act_dtype=act_dtype, activation=activation,
            tp_size=tp_size, ep_size=ep_size,
        )  # fmt: skip

    return {
        "gemm1": key("gemm1", 2 * intermediate, hidden, "swiglu_oai"),
        "gemm2": key("gemm2", hidden, intermediate, "routed_sum"),
    }


def dense_problem(
    *,
    kernel: str,
    kernel_version: str,
    weight_layout: str,
    n: int,
    k: int,
    fmt: str,
    act_dtype: ActivationPolicy = "bf16",
) -> ProblemKey:
    """The problem of one dense MX linear ``[n, k]`` of weight format ``fmt`` (``mxfp4`` or
    ``mxfp8``): role ``dense``, one group of top-1, so no MoE row ever matches it.

    Raises:
        ValueError: ``fmt`` is not a dense MX format.
    """
    if fmt not in DENSE_W_DTYPES:
        raise ValueError(f"unknown dense weight format {fmt!r} (expected one of {tuple(DENSE_W_DTYPES)})")
    return ProblemKey(
        kernel=kernel, kernel_version=str(kernel_version), weight_layout=weight_layout, role=DENSE_ROLE,
        num_experts=1, top_k=1, n=n, k=k, act_dtype=act_dtype, w_dtype=DENSE_W_DTYPES[fmt], activation="none",
    )  # fmt: skip


def layer_problems(
    layer: RankLayer, *, kernel: str, kernel_version: str, weight_layout: str, act_dtype: ActivationPolicy = "bf16"
) -> dict[str, ProblemKey]:
    """:func:`gpt_oss_problems` of a rank's layer record."""
    return gpt_oss_problems(
        kernel=kernel, kernel_version=kernel_version, weight_layout=weight_layout,
        num_experts=layer.num_local_experts, hidden=layer.hidden, intermediate=layer.valid_intermediate,
        top_k=layer.top_k, tp_size=layer.tp_size, ep_size=layer.ep_size, act_dtype=act_dtype,
    )  # fmt: skip


class DeviceFacts(Protocol):
    """What :meth:`Environment.of` needs of a device description (the kernels' ``DeviceInfo``):
    its compute capability and name; ``sm_count``, ``l2_bytes``, ``max_shared_mem``,
    ``mem_bytes`` and the software versions are read when present."""

    @property
    def capability(self) -> tuple[int, int]: ...

    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class Environment:
    """The GPU and software stack a row was measured on, or that a lookup runs on.

    Passed in (never probed inside a heuristic). :meth:`of` builds one from the kernels'
    ``prepkit.kernels.device.DeviceInfo`` (filling software versions from the installed
    packages); :meth:`current` does the same for the current CUDA device, whose facts come from
    ``DeviceInfo.from_torch`` (the one device probe) and whose versions from the loaded stack.
    """

    cc_major: int
    cc_minor: int
    name: str = ""
    sm_count: int = 0
    l2_bytes: int = 0
    smem_per_block_optin: int = 0
    mem_bytes: int = 0
    triton_version: str = ""
    torch_version: str = ""
    cuda_version: str = ""
    driver_version: str = ""
    # The CPU's Triton interpreter described as a GPU of these facts (never stored in a DB).
    stand_in: bool = False

    @property
    def arch(self) -> str:
        return arch_name(self.cc_major, self.cc_minor)

    @property
    def label(self) -> str:
        """How messages name the device: the CPU's interpreter is not called a GPU."""
        return f"the CPU's Triton interpreter (sized as an {self.name})" if self.stand_in else self.name

    @property
    def triton_minor(self) -> str:
        return triton_minor(self.triton_version)

    def identity(self, package_version: str) -> dict[str, Any]:
        """The fields an ``env`` row's hash covers (identity, not measured values)."""
        return {
            "cc_major": self.cc_major, "cc_minor": self.cc_minor, "gpu_name": self.name,
            "sm_count": self.sm_count, "l2_bytes": self.l2_bytes,
            "smem_per_block_optin": self.smem_per_block_optin, "mem_bytes": self.mem_bytes,
            "driver_version": self.driver_version, "cuda_version": self.cuda_version,
            "torch_version": self.torch_version, "triton_version": self.triton_version,
            "package_version": package_version,
        }  # fmt: skip

    @classmethod
    def of(cls, device: Environment | DeviceFacts) -> Environment:
        """Accept an :class:`Environment` or anything with ``capability``/``name``/``sm_count``
        (the kernels' ``DeviceInfo``); versions come from the installed distributions."""
        if isinstance(device, Environment):
            return device
        try:
            cc_major, cc_minor = (int(x) for x in device.capability)
        except (AttributeError, TypeError, ValueError) as err:
            raise TypeError(f"cannot describe the device from {device!r}") from err
        return cls(
            cc_major=cc_major,
            cc_minor=cc_minor,
            name=str(getattr(device, "name", "")),
            sm_count=int(getattr(device, "sm_count", 0)),
            l2_bytes=int(getattr(device, "l2_bytes", 0)),
            smem_per_block_optin=int(getattr(device, "max_shared_mem", 0)),
            mem_bytes=int(getattr(device, "mem_bytes", 0)),
            triton_version=str(getattr(device, "triton_version", "") or _dist_version("triton")),
            torch_version=str(getattr(device, "torch_version", "") or _dist_version("torch")),
            stand_in=bool(getattr(device, "stand_in", False)),
        )

    @classmethod
    def current(cls, device: int | None = None) -> Environment:
        """Describe the current CUDA device.

        Raises:
            DeviceError: torch sees no CUDA device.
        """
        import torch

        from prepkit.errors import DeviceError

        if not torch.cuda.is_available():
            raise DeviceError(
                "no CUDA device is visible to torch",
                hint="run on a machine with an NVIDIA GPU, or check CUDA_VISIBLE_DEVICES and the driver",
            )
        from prepkit.kernels.device import DeviceInfo

        idx = torch.cuda.current_device() if device is None else device
        try:
            import triton

            triton_version = str(triton.__version__)
        except ImportError:
            triton_version = ""
        return replace(
            cls.of(DeviceInfo.from_torch(idx)),
            triton_version=triton_version,
            torch_version=str(torch.__version__),
            cuda_version=str(torch.version.cuda or ""),
            driver_version=_driver_version(),
        )


def _dist_version(name: str) -> str:
    # Package metadata, not an import: reading triton's version must not load triton.
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def _driver_version() -> str:
    try:
        import torch

        v = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
        if v:
            return f"{v // 1000}.{(v % 1000) // 10}"
    except Exception:  # the driver version is informational only
        pass
    return ""

"""Compile the kernels (MoE layer, dense linear, decode projections) for a GPU this machine lacks; read
what the compiler made.

The real launchers of :mod:`prepkit.kernels.mx` run on CPU tensors of the layer's real
shapes (``torch.empty``: nothing is touched) while Triton's active driver is a stand-in whose
current target is the chosen architecture. Triton's JIT specializes every launch exactly as it
would on that GPU (divisibility by 16, integers equal to 1, constexprs, options); a cache hook
records that specialization and tells the JIT to launch nothing; the recorded specializations are
then compiled through ``JITFunction.preload`` (Triton's own path from specialization to binary).
No GPU, no CUDA driver, no tactic DB. Works with triton 3.6 and 3.9.

Per compiled kernel a :class:`CompileReport` holds: registers and local-memory (spill) bytes per
thread (``cuobjdump --dump-resource-usage``), the shared memory a launch would request (Triton's
metadata), the PTX ``.target`` and matrix instruction (native block-scaled MMA, bf16 ``mma.sync``,
``wgmma``), and the SASS instructions of one K step: the loop that holds the matrix instructions,
found by its back-edge branch in the ``nvdisasm`` listing (docs/sm12x.md explains the method).
Variants that :func:`~prepkit.kernels.variants.invalid_reason` rejects are reported as pruned with
its reason and never reach the compiler.

By concern: :mod:`.candidates` (what to compile), :mod:`.moe`, :mod:`.dense`, :mod:`.decode` and
:mod:`.decode_attention` (compiling the MoE layer's kernels, the dense linear's, the decode
projections' and the decode step's attention), :mod:`._compiler` (the stand-in target),
:mod:`.sass` (reading PTX and SASS) and :mod:`.report` (the reports and the failure rule).
``prepkit tune --compile-only`` is the command that runs it.
"""

from prepkit.kernels.compile_check._compiler import interpreter_imported, leave_interpreter
from prepkit.kernels.compile_check.candidates import (
    Candidate,
    arch_device,
    check_candidates,
    default_candidates,
    family,
    sample_candidates,
)
from prepkit.kernels.compile_check.decode import DecodeCandidate, compile_decode, decode_candidates
from prepkit.kernels.compile_check.decode_attention import AttentionCandidate, attention_candidates, compile_attention
from prepkit.kernels.compile_check.dense import DENSE_TOKENS, DenseCandidate, compile_dense, dense_candidates
from prepkit.kernels.compile_check.moe import ProgressFn, check_arch, compile_variants
from prepkit.kernels.compile_check.report import (
    NATIVE_MMA,
    CompileReport,
    Stage,
    Status,
    check_failures,
    failed_defaults,
    format_reports,
    reports_to_json,
)
from prepkit.kernels.compile_check.sass import k_loop, mma_kind

__all__ = [
    "DENSE_TOKENS",
    "NATIVE_MMA",
    "AttentionCandidate",
    "Candidate",
    "CompileReport",
    "DecodeCandidate",
    "DenseCandidate",
    "ProgressFn",
    "Stage",
    "Status",
    "arch_device",
    "attention_candidates",
    "check_arch",
    "check_candidates",
    "check_failures",
    "compile_attention",
    "compile_decode",
    "compile_dense",
    "compile_variants",
    "decode_candidates",
    "default_candidates",
    "dense_candidates",
    "failed_defaults",
    "family",
    "format_reports",
    "interpreter_imported",
    "k_loop",
    "leave_interpreter",
    "mma_kind",
    "reports_to_json",
    "sample_candidates",
]

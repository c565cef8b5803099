"""``prepkit tune --thorough`` on the CPU: its plan, its checks, resume, coverage and the search
each winner records, with stand-in backends (and once the real worker under the interpreter)."""

from __future__ import annotations

import json

import pytest

from prepkit.kernels.device import H100 as H100_INFO
from prepkit.tactics.keys import canon, gpt_oss_problems
from prepkit.tune import SubprocessBackend, kernel_defaults
from prepkit.tune.worker import CHECK_M, SINGLE_CHECK_M

TINY = gpt_oss_problems(
    kernel="moe_mxfp4", kernel_version="1", weight_layout="triton_moe_v3", num_experts=4, hidden=128,
    intermediate=128, top_k=2,
)  # fmt: skip


@pytest.mark.slow
def test_the_real_worker_checks_at_the_token_counts_its_backend_asks_for() -> None:
    """The worker under the interpreter: the thorough check runs one shape, the default four."""
    p = TINY["gemm1"]
    runnable = canon({**json.loads(kernel_defaults(p, H100_INFO)(1)), "upcast": "bits", "weight_load": "ptr"})
    b = SubprocessBackend(env={"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}, check_m=SINGLE_CHECK_M)
    try:
        single = b.check(p, runnable)
        b.check_m = None
        full = b.check(p, runnable)
    finally:
        b.close()
    assert single.passed and single.m_values == SINGLE_CHECK_M == (33,)
    assert full.passed and full.m_values == CHECK_M and len(CHECK_M) == 4
    assert 0 < single.rel_err < 2e-2 and 0 < full.rel_err < 2e-2

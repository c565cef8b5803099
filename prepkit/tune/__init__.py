"""The tuner as a library: sweep the bundled kernel's variants on a GPU into a tactics DB.

- :mod:`~prepkit.tune.run`: one run start to end (:func:`run_tune`), what ``prepkit tune`` calls;
- :mod:`~prepkit.tune.sweep`: the sweep of one GEMM problem and of a whole layer;
- :mod:`~prepkit.tune.candidates`: token points, defaults, the pruned variant space;
- :mod:`~prepkit.tune.decode_sweep`: the decode kernels' sweep (``--decode``), its problems in
  :mod:`~prepkit.tune.decode_problems`, its worker side in :mod:`~prepkit.tune.decode_bench`;
- :mod:`~prepkit.tune.retime`: close calls timed again in rotated rounds;
- :mod:`~prepkit.tune.backend`: where candidates are measured (GPU worker processes, stand-ins);
- :mod:`~prepkit.tune.worker`: the GPU worker process itself (started through :mod:`~prepkit.tune.worker_cli`);
- :mod:`~prepkit.tune.records`: what a sweep produces; :mod:`~prepkit.tune.report`: what people see.

Importing this package imports neither torch nor triton.
"""

from prepkit.tune.backend import Backend, FunctionBackend, SubprocessBackend, Worker
from prepkit.tune.candidates import kernel_candidates, kernel_defaults, parse_tokens, prune_candidates
from prepkit.tune.layer_sweep import tune_layer
from prepkit.tune.records import (
    FAILURES,
    OK,
    CandidateError,
    CheckResult,
    Measurement,
    PointChoice,
    SweepResult,
    Timing,
    WinnerRange,
)
from prepkit.tune.run import TuneOptions, TuneReport, run_tune
from prepkit.tune.sweep import SweepConfig, choose, ranges_from_choices, sweep

__all__ = [
    "FAILURES",
    "OK",
    "Backend",
    "CandidateError",
    "CheckResult",
    "FunctionBackend",
    "Measurement",
    "PointChoice",
    "SubprocessBackend",
    "SweepConfig",
    "SweepResult",
    "Timing",
    "TuneOptions",
    "TuneReport",
    "WinnerRange",
    "Worker",
    "choose",
    "kernel_candidates",
    "kernel_defaults",
    "parse_tokens",
    "prune_candidates",
    "ranges_from_choices",
    "run_tune",
    "sweep",
    "tune_layer",
]

"""The run commands' literal choices (kept literal so --help loads no torch) match the runtime's."""

from __future__ import annotations

import subprocess
import sys

from prepkit.cli._run_options import ACTIVATION_CHOICES, STEP_CHOICES
from prepkit.generation.steps import DECODE_STEPS
from prepkit.kernels.activations import ACTIVATION_POLICIES


def test_choices_are_the_runtimes() -> None:
    assert ACTIVATION_CHOICES == ACTIVATION_POLICIES
    assert STEP_CHOICES == DECODE_STEPS


def test_help_of_the_run_commands_loads_no_torch() -> None:
    for command in ("generate", "bench"):
        code = f"import sys; from prepkit.cli import main; sys.argv = ['prepkit', '{command}', '--help']\n"
        code += "try:\n    main()\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch'"
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "Example:" in result.stdout


def test_the_default_step_is_the_kernels_at_one_row_on_a_gpu_only() -> None:
    import torch

    from prepkit.generation.steps import default_step

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")  # a device object needs no GPU
    assert default_step(gpu) == default_step(gpu, 1) == "kernels"
    assert default_step(gpu, 4) == "compiled"
    assert default_step(cpu) == default_step(cpu, 4) == "modules"

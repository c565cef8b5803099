"""``prepkit env``: versions, GPU, tactics DBs and native MX support, for bug reports."""

from __future__ import annotations

from prepkit import console
from prepkit.cli._app import cli
from prepkit.cli._options import json_option, quiet_option

# What a missing version reads as: no CUDA build or no driver is a fact, not a missing package.
ABSENT = {"cuda": "none", "driver": "none (no NVIDIA driver loaded)"}


@cli.command("env")
@json_option
@quiet_option
def env_command(as_json: bool, quiet: bool) -> None:
    """Print versions, the GPU, the tactics DBs found and native MX support, for bug reports.

    \b
    Example:
        prepkit env
        prepkit env --json
    """
    from prepkit.env import report

    env = report()
    if as_json:
        console.emit_json(env)
        return
    for name, version in env["versions"].items():
        console.result(f"{name}: {version or ABSENT.get(name, 'not installed')}")
    console.result(f"os: {env['os']}")
    triton = env["triton_vs_bundled"]
    if triton["differs"]:
        console.warn(
            f"triton {triton['installed']} is not the {', '.join(triton['bundled_rows_measured_with'])} the bundled "
            "tactics rows were measured with: their picks may not be the fastest here (`prepkit tune` measures "
            "this install)"
        )
    gpu = env["gpu"]
    console.result(f"gpu: {gpu['name']} ({gpu['arch']})" if gpu else "gpu: none (no CUDA device)")
    console.result(f"kernel version: {env['kernel_version'] or 'unknown (the kernel cannot be imported)'}")
    for source, db in env["tactics_dbs"].items():
        where = f"tactics DB ({source}): {db['path']}"
        if not db["exists"]:
            console.result(f"{where} (absent)")
        elif "error" in db:
            console.result(f"{where}: {db['error']}")
        else:
            here = f", {db['rows_for_this_gpu']} for this GPU" if gpu else ""
            console.result(f"{where}: {db['winner_rows']} rows, {db['rows_for_kernel_version']} for this kernel{here}")
    if triton["bundled_rows_measured_with"]:
        same = "differs" if triton["differs"] else "same minor"
        console.result(f"bundled rows measured with triton: {', '.join(triton['bundled_rows_measured_with'])} ({same})")
    native = env["mx_native"]
    console.result("mx native: " + ("unknown (no GPU or no triton)" if native is None else "yes" if native else "no"))

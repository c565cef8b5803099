from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from prepkit.cli import cli
from prepkit.constants import JOURNAL_NAME, MANIFEST_NAME, SYNTH_RECORD


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def hashes(out: Path) -> dict[str, str]:
    return {k: v["sha256"] for k, v in json.loads((out / MANIFEST_NAME).read_text())["files"].items()}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_prepare_then_verify_against_source(synthetic_ckpt: Path, tmp_path: Path, tp: int) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run(
        "prepare", "--src", str(synthetic_ckpt), "--tp", str(tp), "--out", str(out), "--json", "-q"
    )
    assert code == 0, stderr
    summary = json.loads(stdout)
    assert summary["files_written"] == tp * 2 + 1
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["layout"]["id"] == "trtllm_gen_v1"
    assert [r["rank"] for r in manifest["ranks"]] == list(range(tp))
    assert manifest["model"]["provenance"] == "prepkit synth"
    assert all(v["sha256"] for v in manifest["model"]["source_files"].values())
    assert not (out / JOURNAL_NAME).exists()
    # each rank folder is self-contained: its index resolves every tensor to a file beside it
    for r in range(tp):
        index = json.loads((out / f"rank{r}" / "model.safetensors.index.json").read_text())
        for name, file in index["weight_map"].items():
            assert (out / f"rank{r}" / file).is_file(), name
        with safe_open(str(out / f"rank{r}" / "experts-00001.safetensors"), framework="pt") as f:
            assert "model.layers.1.mlp.experts.w3_w1_weight" in set(f.keys())
    code, stdout, stderr = run("verify", str(out), "--src", str(synthetic_ckpt), "--json", "-q")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["experts_checked"] == tp * 2 * 3 and report["ok"]


def test_non_expert_tensors_are_stored_once(synthetic_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("prepare", "--src", str(synthetic_ckpt), "--tp", "4", "--out", str(out), "-q")[0] == 0
    shared = out / "shared" / "non-expert-00000.safetensors"
    inodes = {(out / f"rank{r}" / shared.name).stat().st_ino for r in range(4)}
    assert inodes == {shared.stat().st_ino}


def test_dry_run_writes_nothing_and_prints_the_plan(synthetic_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run(
        "prepare", "--src", str(synthetic_ckpt), "--tp", "2", "--out", str(out), "--dry-run", "--json"
    )
    assert code == 0, stderr
    plan = json.loads(stdout)["plan"]
    assert [r["valid_intermediate"] for r in plan["ranks"]] == [1440, 1440]
    assert plan["warnings"] and "1.2" in plan["warnings"][0]
    assert not out.exists()
    code, stdout, _ = run(
        "prepare",
        "--src",
        str(synthetic_ckpt),
        "--tp",
        "2",
        "--out",
        str(out),
        "--dry-run",
        "--json",
        "--trtllm-version",
        "1.2",
    )
    assert [r["valid_intermediate"] for r in json.loads(stdout)["plan"]["ranks"]] == [1536, 1344]


def test_ep_and_rank_selection(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run(
        "prepare", "--src", str(ep_ckpt), "--tp", "2", "--ep", "2", "--rank", "3", "--out", str(out), "--json", "-q"
    )
    assert code == 0, stderr
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert [(r["rank"], r["expert_range"]) for r in manifest["ranks"]] == [(3, [2, 4])]
    assert run("verify", str(out), "--src", str(ep_ckpt), "-q")[0] == 0


def test_rerun_is_a_no_op_with_identical_bytes(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")[0] == 0
    before = hashes(out)
    code, stdout, _ = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q", "--json")
    assert code == 0 and json.loads(stdout)["files_written"] == 0
    assert hashes(out) == before


def _kill_mid_run(src: Path, out: Path, when: str) -> None:
    cmd = [sys.executable, "-m", "prepkit", "prepare", "--src", str(src), "--tp", "2", "--out", str(out), "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if when == "tmp" and list(out.glob("rank*/*.tmp-*")):
                break
            if when == "file" and list(out.glob("rank*/experts-*.safetensors")):
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("when", ["tmp", "file"])
def test_kill_9_then_rerun_gives_identical_bytes(tmp_path: Path, when: str) -> None:
    from prepkit.synth import write_synthetic_checkpoint

    src = write_synthetic_checkpoint(tmp_path / "src", num_layers=6, num_experts=3, num_shards=2, seed=7)
    clean = tmp_path / "clean"
    assert run("prepare", "--src", str(src), "--tp", "2", "--out", str(clean), "-q")[0] == 0
    out = tmp_path / "killed"
    _kill_mid_run(src, out, when)
    if (out / MANIFEST_NAME).exists():
        pytest.skip("the run finished before it could be killed")
    # nothing left looks complete: no manifest, and verify refuses the folder
    code, _, stderr = run("verify", str(out))
    assert code == 6 and "interrupted" in stderr
    code, stdout, stderr = run("prepare", "--src", str(src), "--tp", "2", "--out", str(out), "-q", "--json")
    assert code == 0, stderr
    assert hashes(out) == hashes(clean)
    assert not list(out.glob("**/*.tmp-*"))


def test_foreign_output_folder_is_refused(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, stderr = run("prepare", "--src", str(ep_ckpt), "--out", str(out), "-q")
    assert code == 3 and "not a prepkit output folder" in stderr and "Traceback" not in stderr


def test_output_of_another_plan_is_refused(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")[0] == 0
    code, _, stderr = run("prepare", "--src", str(ep_ckpt), "--tp", "4", "--out", str(out), "-q")
    assert code == 3 and "different prepared shard set" in stderr


def test_split_that_does_not_fit(ep_ckpt: Path, tmp_path: Path) -> None:
    code, _, stderr = run("prepare", "--src", str(ep_ckpt), "--ep", "3", "--out", str(tmp_path / "o"), "-q")
    assert code == 3 and "split evenly over ep=3" in stderr
    code, _, stderr = run("prepare", "--src", str(ep_ckpt), "--tp", "16", "--out", str(tmp_path / "o"), "-q")
    assert code == 3 and "without intermediate rows" in stderr
    assert not (tmp_path / "o").exists()


def test_bad_source_is_reported_without_traceback(ep_ckpt: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ep_ckpt, src)
    victim = sorted(src.glob("model-*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:1000])
    code, _, stderr = run("prepare", "--src", str(src), "--out", str(tmp_path / "o"), "-q")
    assert code == 3 and victim.name in stderr and "Traceback" not in stderr
    assert not (tmp_path / "o").exists()


def test_not_enough_disk_is_refused_before_writing(
    ep_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prepkit.prepare import plan as prepare_plan

    monkeypatch.setattr(prepare_plan, "free_bytes", lambda path: 1000)
    code, _, stderr = run("prepare", "--src", str(ep_ckpt), "--out", str(tmp_path / "o"), "-q")
    assert code == 3 and "free" in stderr
    assert not (tmp_path / "o" / MANIFEST_NAME).exists()


def test_disk_full_mid_run_leaves_nothing_complete(
    ep_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real_pwrite = os.pwrite

    def failing_pwrite(fd: int, data: bytes, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] > 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    out = tmp_path / "o"
    code, _, stderr = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")
    assert code == 3 and "No space left" in stderr or "no space" in stderr.lower()
    assert not (out / MANIFEST_NAME).exists()
    assert not list(out.glob("**/*.tmp-*"))
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")[0] == 0


def test_verify_names_the_corrupted_file_and_expert(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")[0] == 0
    victim = out / "rank1" / "experts-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor's bytes
    victim.write_bytes(bytes(data))
    code, _, stderr = run("verify", str(out))
    assert code == 6 and "rank1/experts-00001.safetensors: sha256 differs" in stderr
    # same corruption with the manifest hash updated: only the inverse against the source finds it
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    from prepkit.fsutil import sha256_file

    manifest["files"]["rank1/experts-00001.safetensors"]["sha256"] = sha256_file(victim)
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert run("verify", str(out))[0] == 0
    code, _, stderr = run("verify", str(out), "--src", str(ep_ckpt))
    assert code == 6 and "rank 1, layer 1, expert 3" in stderr


def test_every_command_has_help_with_an_example() -> None:
    for name, command in cli.commands.items():
        code, stdout, _ = run(name, "--help")
        assert code == 0, name
        if not hasattr(command, "commands"):
            assert "Example:" in stdout, name


def test_main_entry_point_exit_codes(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "prepkit", "verify", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 6 and "Error:" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "prepkit", "prepare", "--tp", "0"], capture_output=True, text=True)
    assert proc.returncode == 2


def test_source_hashes_come_from_the_record_only_for_unchanged_files(ep_ckpt: Path, tmp_path: Path) -> None:
    from prepkit.fsutil import sha256_file

    src = tmp_path / "src"
    shutil.copytree(ep_ckpt, src)
    record_path = src / SYNTH_RECORD
    record = json.loads(record_path.read_text())
    shard = sorted(src.glob("model-*.safetensors"))[0]
    # a record that lies about a file of another size must not be believed
    for f in record["files"]:
        if f["path"] == shard.name:
            f["size"] += 1
            f["sha256"] = "0" * 64
    record_path.write_text(json.dumps(record))
    out = tmp_path / "out"
    assert run("prepare", "--src", str(src), "--out", str(out), "-q")[0] == 0
    files = json.loads((out / MANIFEST_NAME).read_text())["model"]["source_files"]
    assert files[shard.name]["sha256"] == sha256_file(shard)
    # without any record the folder is hashed during the run
    record_path.unlink()
    out2 = tmp_path / "out2"
    assert run("prepare", "--src", str(src), "--out", str(out2), "-q")[0] == 0
    model = json.loads((out2 / MANIFEST_NAME).read_text())["model"]
    assert model["provenance"] == "local folder"
    assert model["source_files"][shard.name]["sha256"] == sha256_file(shard)


def test_the_source_record_is_read_once_per_run(ep_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prepkit.prepare import provenance

    reads: list[Path] = []
    real_read = provenance.read_synth_record

    def counting(model_dir: Path) -> object:
        reads.append(Path(model_dir))
        return real_read(model_dir)

    monkeypatch.setattr(provenance, "read_synth_record", counting)
    out = tmp_path / "out"
    assert run("prepare", "--src", str(ep_ckpt), "--out", str(out), "-q")[0] == 0
    assert reads == [ep_ckpt]
    # and what it vouched for is what the manifest cites
    record = {f["path"]: f["sha256"] for f in json.loads((ep_ckpt / SYNTH_RECORD).read_text())["files"]}
    cited = json.loads((out / MANIFEST_NAME).read_text())["model"]["source_files"]
    assert cited and {name: f["sha256"] for name, f in cited.items()} == {name: record[name] for name in cited}


def test_a_resume_after_a_full_disk_needs_only_the_space_still_to_write(
    ep_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prepkit.prepare import plan as prepare_plan
    from prepkit.prepare import write

    # The disk fills while layer 1 is written, after the shared file is finished and recorded.
    real_write_chunk = write._RankFile.write_chunk

    def full_at_layer_1(self: write._RankFile, *args: object) -> None:
        if self.rel.endswith("experts-00001.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_chunk(self, *args)

    monkeypatch.setattr(write._RankFile, "write_chunk", full_at_layer_1)
    out = tmp_path / "out"
    args = ("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")
    code, _, stderr = run(*args)
    assert code == 3 and "no space" in stderr.lower()
    monkeypatch.setattr(write._RankFile, "write_chunk", real_write_chunk)

    code, stdout, stderr = run(*args[:-1], "--dry-run", "--json")
    assert code == 0, stderr
    plan = json.loads(stdout)["plan"]
    experts = sum(r["bytes"] for r in plan["ranks"])
    assert experts == plan["bytes_to_write"] - plan["shared_bytes"]
    # layer 0's files, whole under their final names, are kept (journaled or adopted): only the
    # rest of the experts is left
    kept = list(out.glob("rank*/experts-00000.safetensors"))
    assert plan["bytes_left"] == experts - experts * len(kept) // 4  # 2 ranks x 2 layers of equal size
    assert 0 < plan["bytes_left"] < plan["bytes_to_write"]
    code, stdout, _ = run(*args[:-1], "--dry-run")
    assert "still to write" in stdout

    # Free space between what is left and the whole output: a fresh run is refused, the resume runs.
    free = (plan["bytes_left"] + plan["bytes_to_write"]) // 2
    monkeypatch.setattr(prepare_plan, "free_bytes", lambda path: free)
    code, _, stderr = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(tmp_path / "fresh"), "-q")
    assert code == 3 and "free" in stderr
    code, _, stderr = run(*args)
    assert code == 0, stderr
    # and a rerun on the finished folder needs nothing, even on a full disk
    monkeypatch.setattr(prepare_plan, "free_bytes", lambda path: 0)
    code, _, stderr = run(*args)
    assert code == 0, stderr
    monkeypatch.undo()
    clean = tmp_path / "clean"
    assert run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(clean), "-q")[0] == 0
    assert hashes(out) == hashes(clean)


# Runs one huge --tp or --ep dry run under an address-space cap (so code that builds every rank
# fails fast instead of swapping), timing it and measuring its peak memory from inside.
_HUGE_SPLIT_PROBE = """
import json, resource, sys, time
from click.testing import CliRunner
from prepkit.cli import cli

option, src, out = sys.argv[1:]
# a sane dry run first: the lazy imports of the command are not what is timed
assert CliRunner().invoke(cli, ["prepare", "--src", src, "--out", out, "--dry-run", "-q"]).exit_code == 0
vm = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize:"))) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 2 * 1024**3, resource.RLIM_INFINITY))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
result = CliRunner().invoke(cli, ["prepare", "--src", src, option, "100000000", "--out", out, "--dry-run"])
seconds = time.perf_counter() - start
grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"code": result.exit_code, "stderr": result.stderr, "seconds": seconds, "grown_kib": grown_kib}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and caps the address space")
@pytest.mark.parametrize(
    "option, reason", [("--tp", "groups of 32 rows"), ("--ep", "cannot be split evenly")], ids=["tp", "ep"]
)
def test_a_huge_split_is_refused_at_once_with_bounded_memory(
    ep_ckpt: Path, tmp_path: Path, option: str, reason: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _HUGE_SPLIT_PROBE, option, str(ep_ckpt), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    probe = json.loads(proc.stdout.splitlines()[-1])
    # a split the model cannot take is bad input (exit 3), as every layout's split refusal is
    assert probe["code"] == 3, probe["stderr"]
    assert reason in probe["stderr"] and "100000000" in probe["stderr"]
    assert "Traceback" not in probe["stderr"]
    assert probe["seconds"] < 1.0
    assert probe["grown_kib"] < 64 * 1024
    assert not (tmp_path / "o").exists()

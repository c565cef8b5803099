"""What ``prepare`` makes of an output folder left by an earlier run: a killed run's leftovers are
cleared and the run resumes; another plan's folder, finished or not, is refused with what differs
and how to start over."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.constants import JOURNAL_NAME, MANIFEST_NAME, PREPARE_LOCK


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stderr


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_folder_holding_only_a_killed_runs_temp_file_resumes(ep_ckpt: Path, tmp_path: Path) -> None:
    # What a run killed in its first second left before the journal came first: one temp file.
    out = tmp_path / "out"
    leftover = out / "shared" / f"non-expert-00000.safetensors.tmp-{_dead_pid()}"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"\0" * 1000)
    code, stderr = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")
    assert code == 0, stderr
    assert not leftover.exists() and not list(out.rglob("*.tmp-*"))
    assert run("verify", str(out), "--src", str(ep_ckpt))[0] == 0


def _interrupted(ckpt: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that stops after a few writes (the disk fills), leaving its journal."""
    real_pwrite = os.pwrite
    calls = {"n": 0}

    def failing_pwrite(fd: int, data: bytes, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] > 12:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", failing_pwrite)
        code, _ = run("prepare", "--src", str(ckpt), "--tp", "2", "--out", str(out), "-q")
    assert code == 3 and (out / JOURNAL_NAME).is_file() and not (out / MANIFEST_NAME).exists()


def test_unfinished_run_of_other_options_is_refused_with_what_differs(
    ep_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    _interrupted(ep_ckpt, out, monkeypatch)
    before = sorted(p.name for p in out.rglob("*"))
    code, stderr = run("prepare", "--src", str(ep_ckpt), "--tp", "4", "--out", str(out), "-q")
    assert code == 3 and "Traceback" not in stderr
    assert f"holds an unfinished run of another plan (started from {ep_ckpt})" in stderr
    assert "--tp is 2 there, 4 here" in stderr and f"delete {out}" in stderr
    code, stderr = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--trtllm-version", "1.2", "--out", str(out))
    assert code == 3 and "--trtllm-version is main there, 1.2 here" in stderr
    assert sorted(p.name for p in out.rglob("*")) == before  # a refused run writes nothing
    # the command that started it finishes it
    code, stderr = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")
    assert code == 0, stderr


def test_finished_folder_of_other_options_is_refused_with_what_differs(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")[0] == 0
    code, stderr = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--layout", "cutlass-sm90", "--out", str(out))
    assert code == 3 and "holds a different prepared shard set" in stderr
    assert "--layout is trtllm_gen_v1 there, cutlass_sm90_v1 here" in stderr and f"delete {out}" in stderr


def test_unreadable_journal_is_named(ep_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    _interrupted(ep_ckpt, out, monkeypatch)
    (out / JOURNAL_NAME).write_text('{"fingerprint": ')
    code, stderr = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")
    assert code == 3 and str(out / JOURNAL_NAME) in stderr and "cannot be read" in stderr
    assert "Traceback" not in stderr


def test_prepared_files_without_journal_or_manifest_are_not_trusted(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")[0] == 0
    (out / MANIFEST_NAME).unlink()
    code, stderr = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")
    assert code == 3 and "neither manifest.json nor a journal" in stderr and f"delete {out}" in stderr


def test_a_finished_folder_keeps_only_its_lock_beside_the_output(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")[0] == 0
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    listed = {MANIFEST_NAME, *manifest["files"], *(f for r in manifest["ranks"] for f in r["files"])}
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert on_disk - listed == {PREPARE_LOCK}


def test_every_rename_and_link_into_the_folder_is_followed_by_a_sync_of_its_parent(
    ep_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rename is durable only once its folder is synced: record both, and check the order.
    events: list[tuple[str, int]] = []
    real_replace, real_link, real_fsync = os.replace, os.link, os.fsync

    def replace(src: str | Path, dst: str | Path) -> None:
        real_replace(src, dst)
        events.append(("name", os.stat(Path(dst).parent).st_ino))

    def link(src: str | Path, dst: str | Path) -> None:
        real_link(src, dst)
        events.append(("name", os.stat(Path(dst).parent).st_ino))

    def fsync(fd: int) -> None:
        real_fsync(fd)
        st = os.fstat(fd)
        if st.st_mode & 0o040000:
            events.append(("sync", st.st_ino))

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "out"
    code, stderr = run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")
    assert code == 0, stderr
    named = [i for i, (kind, _) in enumerate(events) if kind == "name"]
    assert len(named) >= 10  # shared file, 4 rank files, 2 links, 2 indexes, the manifest, the journal
    for i in named:
        folder = events[i][1]
        assert ("sync", folder) in events[i + 1 :], f"event {i}: no sync of the folder after it"
    # the folders prepare created are synced into their parents too
    synced = {ino for kind, ino in events if kind == "sync"}
    assert {os.stat(p).st_ino for p in (tmp_path, out, out / "shared", out / "rank0")} <= synced

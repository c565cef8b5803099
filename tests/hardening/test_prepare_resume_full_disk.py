"""A full disk striking the journal's rewrite, after files got their final names: the resume adopts
those files instead of asking for their bytes again, and a finished folder reruns on a full disk
without writing a byte."""

from __future__ import annotations

import errno
import hashlib
import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.constants import JOURNAL_NAME, MANIFEST_NAME
from prepkit.shards import Journal


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def _tensor_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - header_len


def _final_tensor_files(out: Path) -> set[str]:
    """Tensor files under their final names (rank folders' links to the shared files aside)."""
    return {
        p.relative_to(out).as_posix()
        for p in out.rglob("*.safetensors")
        if p.parent.name == "shared" or p.name.startswith("experts-")
    }


def _snapshot(out: Path) -> dict[str, tuple[int, int, str]]:
    return {
        p.relative_to(out).as_posix(): (
            p.stat().st_mtime_ns,
            p.stat().st_ino,
            hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def _no_space(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fail_at", [2, 4])
def test_a_resume_adopts_files_the_journal_missed(
    ep_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    from prepkit.prepare import plan as prepare_plan

    out = tmp_path / "out"
    args = ("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out))
    real_save = Journal.save
    saves = {"n": 0}

    def save_until_full(self: Journal) -> None:
        saves["n"] += 1
        if saves["n"] >= fail_at:  # the disk fills as the journal is rewritten for a finished file
            _no_space()
        real_save(self)

    with monkeypatch.context() as m:
        m.setattr(Journal, "save", save_until_full)
        code, _, stderr = run(*args, "-q")
    assert code == 3 and "no space" in stderr.lower(), stderr
    journal = json.loads((out / JOURNAL_NAME).read_text())
    on_disk = _final_tensor_files(out)
    missed = on_disk - set(journal["files"])
    assert missed, "the scenario needs a file under its final name that the journal lacks"

    code, stdout, stderr = run(*args, "--dry-run", "--json")
    assert code == 0, stderr
    plan = json.loads(stdout)["plan"]
    left = plan["bytes_to_write"] - sum(_tensor_bytes(out / rel) for rel in on_disk)
    assert plan["bytes_left"] == left

    # Exactly the room still needed: the resume runs, writes only what is missing, and ends equal
    # to a clean run.
    monkeypatch.setattr(prepare_plan, "free_bytes", lambda path: left)
    code, stdout, stderr = run(*args, "--json")
    assert code == 0, stderr
    summary = json.loads(stdout)
    assert summary["files_skipped"] == len(on_disk)
    assert summary["bytes_written"] < plan["bytes_to_write"]
    monkeypatch.undo()
    clean = tmp_path / "clean"
    assert run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(clean), "-q")[0] == 0
    assert {k: v[2] for k, v in _snapshot(out).items() if k != ".prepkit-lock"} == {
        k: v[2] for k, v in _snapshot(clean).items() if k != ".prepkit-lock"
    }
    assert run("verify", str(out), "--src", str(ep_ckpt))[0] == 0


def test_a_finished_folder_reruns_on_a_full_disk_writing_nothing(
    ep_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prepkit import locks, shards
    from prepkit.prepare import plan as prepare_plan

    out = tmp_path / "out"
    args = ("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out))
    assert run(*args, "-q")[0] == 0
    before = _snapshot(out)
    tensor_files = len(_final_tensor_files(out))

    monkeypatch.setattr(prepare_plan, "free_bytes", lambda path: 0)
    monkeypatch.setattr(Journal, "save", _no_space)
    monkeypatch.setattr(shards, "write_output_file", _no_space)
    monkeypatch.setattr(locks, "open", _no_space, raising=False)  # even the lock's pid cannot be written
    code, stdout, stderr = run(*args)
    assert code == 0, stderr
    assert f"0 files written, {tensor_files} already complete" in stderr
    assert not (out / JOURNAL_NAME).exists() and (out / MANIFEST_NAME).is_file()
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k != ".prepkit-lock"} == {
        k: v for k, v in before.items() if k != ".prepkit-lock"
    }


def test_a_damaged_finished_folder_is_repaired_not_trusted(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ("prepare", "--src", str(ep_ckpt), "--tp", "2", "--out", str(out), "-q")
    assert run(*args)[0] == 0
    victim = out / "rank1" / "experts-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, _, stderr = run(*args)
    assert code == 0, stderr
    assert run("verify", str(out), "--src", str(ep_ckpt))[0] == 0

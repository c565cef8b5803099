"""Names that say what was read: a synthetic checkpoint is marked and named so, ``prepkit env``
reports what a bug report needs, and ``tactics show`` says which kernel version it serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.constants import SYNTH_RECORD


def run(*args: str, **env: str):
    return CliRunner(env=env or None).invoke(cli, list(args))


@pytest.fixture(scope="module")
def small_synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "ckpt"
    r = run("synth", "--out", str(out), "--layers", "2", "--experts", "4", "--hidden", "256", "--intermediate", "512")
    assert r.exit_code == 0, r.output
    return out


def test_synth_records_that_it_is_synthetic_and_its_size(small_synth: Path) -> None:
    from prepkit.synth import read_synth_record

    raw = json.loads((small_synth / SYNTH_RECORD).read_text())
    assert raw["synthetic"] is True and raw["num_layers"] == 2 and raw["num_experts"] == 4
    assert raw["recipe"] == "gpt-oss-120b"
    record = read_synth_record(small_synth)
    assert record is not None and record.label("gpt-oss-120b") == "synthetic-gpt-oss-120b-2l-4e-h256-i512"


def test_prepare_names_a_synthetic_checkpoint_for_what_it_is(
    small_synth: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    r = run("prepare", "--src", str(small_synth), "--tp", "2", "--dry-run")
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert text.startswith("synthetic-gpt-oss-120b-2l-4e-h256-i512 from "), text
    assert "into prepared/synthetic-gpt-oss-120b-2l-4e-h256-i512-trtllm-gen-tp2" in text
    plan = json.loads(run("prepare", "--src", str(small_synth), "--tp", "2", "--dry-run", "--json").stdout)
    assert plan["plan"]["out"] == "prepared/synthetic-gpt-oss-120b-2l-4e-h256-i512-trtllm-gen-tp2"


def test_a_real_checkpoint_keeps_the_recipe_name(ep_ckpt: Path, tmp_path: Path, monkeypatch) -> None:
    (ep_ckpt / SYNTH_RECORD).rename(tmp_path / SYNTH_RECORD)  # as a hub download: no synth record
    try:
        monkeypatch.chdir(tmp_path)
        plan = json.loads(run("prepare", "--src", str(ep_ckpt), "--tp", "2", "--dry-run", "--json").stdout)
        assert plan["plan"]["out"] == "prepared/gpt-oss-120b-trtllm-gen-tp2"
    finally:
        (tmp_path / SYNTH_RECORD).rename(ep_ckpt / SYNTH_RECORD)


def test_env_reports_versions_gpu_dbs_and_native_mx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prepkit import env
    from prepkit.kernels.mx import KERNEL_VERSION
    from tests.tactics.test_db import fill

    user_db = tmp_path / "user.db"
    fill(user_db)  # rows of kernel version "1" on an H100
    monkeypatch.setenv("PREPKIT_TACTICS_DB", str(user_db))
    r = run("env", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["versions"]["prepkit"] and doc["versions"]["torch"] and doc["kernel_version"] == str(KERNEL_VERSION)
    user = doc["tactics_dbs"]["user"]
    assert user["path"] == str(user_db) and user["winner_rows"] == 3 and user["rows_for_kernel_version"] == 0
    assert doc["tactics_dbs"]["bundled"]["rows_for_kernel_version"] > 0

    monkeypatch.setattr(env, "installed_kernel_version", lambda: "1")
    monkeypatch.setattr(env, "_gpu", lambda: {"name": "NVIDIA H100", "capability": [9, 0], "arch": "sm90"})
    doc = env.report()
    assert doc["tactics_dbs"]["user"]["rows_for_this_gpu"] == 3 and doc["mx_native"] is False
    monkeypatch.setattr(env, "_gpu", lambda: {"name": "NVIDIA RTX PRO 6000", "capability": [12, 0], "arch": "sm120"})
    doc = env.report()
    assert doc["tactics_dbs"]["user"]["rows_for_this_gpu"] == 0 and isinstance(doc["mx_native"], bool)
    text = " ".join(run("env").stdout.split())
    assert "kernel version:" in text and f"tactics DB (user): {user_db}" in text and "mx native:" in text


def test_tactics_show_says_which_kernel_version_it_serves() -> None:
    from prepkit.kernels.mx import KERNEL_VERSION
    from prepkit.tactics.lookup import bundled_db_path

    db = str(bundled_db_path())
    r = run("tactics", "show", "--db", db)
    assert r.exit_code == 0 and f"this install serves v{KERNEL_VERSION}" in " ".join(r.stdout.split())
    assert "(served here)" in r.stdout
    doc = json.loads(run("tactics", "show", "--db", db, "--json").stdout)
    assert doc["kernel_version_served"] == str(KERNEL_VERSION)

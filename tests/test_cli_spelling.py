"""One spelling per concept across commands (``--out`` for what a command writes); the spellings
they replaced before the first release are refused."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner, Result

from prepkit.cli import cli

SMALL = ["--layers", "1", "--experts", "2", "--top-k", "2", "--hidden", "64", "--intermediate", "64", "-q"]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _shards(folder: Path) -> int:
    return len(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))


def test_synth_takes_out_and_num_shards_only(tmp_path: Path) -> None:
    new = tmp_path / "new"
    assert invoke("synth", "--out", str(new), "--num-shards", "2", *SMALL).exit_code == 0
    assert _shards(new) == 2
    shown = invoke("synth", "--help").stdout
    assert "--out" in shown and "--num-shards" in shown
    assert "--shards" not in shown and "[OUT]" not in shown
    r = invoke("synth", "--out", str(tmp_path / "old"), "--shards", "2", *SMALL)
    assert r.exit_code == 2 and "No such option '--shards'" in r.stderr
    assert not (tmp_path / "old").exists()


def test_synth_without_out_or_with_a_positional_folder_is_a_usage_error(tmp_path: Path) -> None:
    r = invoke("synth", *SMALL)
    assert r.exit_code == 2 and "Missing option '--out'" in r.stderr
    r = invoke("synth", str(tmp_path / "a"), "--out", str(tmp_path / "b"), *SMALL)
    assert r.exit_code == 2 and "unexpected extra argument" in r.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

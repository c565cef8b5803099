"""A fetch killed (SIGKILL) at any point resumes: the rerun ends with every file present and
verified, a fetch record and no temp file of ours, and downloads only what the killed run had not
finished. A partial download the kill leaves is never under a final name; huggingface_hub's cache
scan lists it, so that `hf cache prune` removes it.

The fetch runs in a child process through the real ``prepkit fetch`` command against olah, into a
private Hugging Face cache. The child slows down one step (planning, streaming the big shard, or
hashing it) and drops a marker file when it is there, so the kill lands inside that step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
from click.testing import CliRunner

from prepkit import fetch as fetching
from prepkit.cli import cli
from prepkit.constants import FETCH_RECORD
from prepkit.fetch.record import STATE_PATH
from tests.fetch import olah_server
from tests.fetch.test_fetch_olah import DEFAULT_FILES, OLAH_CLI, _write_source

pytestmark = pytest.mark.skipif(OLAH_CLI is None or shutil.which("git") is None, reason="needs olah-cli and git")

REPO = "testorg/kill-gpt-oss"
BIG_SHARD = "model-00000-of-00002.safetensors"

# argv: step, marker file, then the fetch arguments. Each slowed step waits long enough (30 s)
# that the test always kills it there.
CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from prepkit.fetch import hub, record

    step, marker = sys.argv[1], Path(sys.argv[2])
    BIG = "model-00000-of-00002.safetensors"

    def arrived():
        marker.touch()
        time.sleep(30)

    if step == "planning":
        real_list = hub.list_remote
        def list_remote(*args, **kwargs):
            arrived()
            return real_list(*args, **kwargs)
        hub.list_remote = list_remote
    elif step == "streaming":
        real_advance = hub.Progress.advance
        def advance(self, n):
            real_advance(self, n)
            if n >= 2**20:  # only the big shard is over 1 MiB
                arrived()
        hub.Progress.advance = advance
    elif step == "hashing":
        real_verify = record.verify_file
        def verify_file(dest, remote):
            if remote.path == BIG:
                arrived()
            return real_verify(dest, remote)
        record.verify_file = verify_file

    from prepkit.cli import main
    sys.argv = ["prepkit", *sys.argv[3:]]
    main()
    """
)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    assert OLAH_CLI is not None
    work = tmp_path_factory.mktemp("olah-kill")
    src = _write_source(work / "src")
    (src / BIG_SHARD).write_bytes(os.urandom(16 * 2**20))  # streams long enough to be killed inside
    olah_server.build_mirror_repo(src, work / "mirrors", REPO)
    with olah_server.serve(work / "mirrors", work, probe_repo=REPO, olah_cli=OLAH_CLI) as url:
        yield url, src


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".incomplete") or ".tmp-" in p.name]


@pytest.mark.parametrize("step", ["planning", "streaming", "hashing"])
def test_fetch_killed_mid_step_resumes_complete_and_verified(
    endpoint: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    url, src = endpoint
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    args = ["fetch", "--model", REPO, "--endpoint", url, "--max-workers", "1", "-q"]
    marker = tmp_path / "arrived"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, step, str(marker), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None, f"fetch ended before {step}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"fetch never reached {step}"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=20)
    assert proc.returncode == -signal.SIGKILL

    snapshots = list(cache.glob("models--*/snapshots/*"))
    assert not any((s / FETCH_RECORD).exists() for s in snapshots)  # nothing looks complete
    big_blob_done = any((s / BIG_SHARD).exists() for s in snapshots)
    partial = _leftovers(cache)
    if step == "streaming":
        assert partial, "the kill should leave the big shard's partial file"
    # A temp file of a killed state write, which the rerun must clear too.
    for snapshot in snapshots:
        stray = snapshot / STATE_PATH.parent / "fetch-state.json.tmp-999999-1"
        stray.parent.mkdir(parents=True, exist_ok=True)
        stray.write_text("{")

    result = CliRunner().invoke(cli, [*args[:-1], "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr
    summary = json.loads(result.stdout)
    dest = Path(summary["dir"])
    for name in DEFAULT_FILES:
        assert (dest / name).read_bytes() == (src / name).read_bytes(), name
    record = fetching.read_fetch_record(dest)
    assert record is not None and {e.path for e in record.entries} == DEFAULT_FILES
    assert _leftovers(cache) == partial  # the rerun left none of its own
    assert {p.file_path for p in huggingface_hub.scan_cache_dir(cache).incomplete_files} == set(partial)
    if step == "hashing":
        assert big_blob_done and BIG_SHARD not in summary["downloaded"]  # downloaded once, hashed on rerun
    if step == "streaming":
        assert BIG_SHARD in summary["downloaded"]

    # And the folder is really verified: an offline check, no network, passes.
    offline = CliRunner().invoke(cli, ["fetch", "--model", REPO, "--offline", "--json"])
    assert offline.exit_code == 0, offline.stderr
    assert json.loads(offline.stdout)["downloaded"] == []

"""``prepkit fetch`` paths a real server cannot produce (gated repo, hub-style RevisionNotFound, 5xx,
a transfer breaking off, disk full), plus the pure parts (sources, folders, the record).

The fake hub here is two monkeypatches: the tree listing comes from a local folder, and
``snapshot_download`` copies from it, one file at a time. Everything else runs for real.
"""

from __future__ import annotations

import errno
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import huggingface_hub
import pytest
from click.testing import CliRunner, Result
from huggingface_hub import errors as hf_errors

from prepkit import fetch as fetching
from prepkit.constants import FETCH_RECORD
from prepkit.errors import FetchError, RecipeError
from prepkit.fetch import hub as fetch_hub
from prepkit.fetch import record as fetch_record
from prepkit.fetch import run as fetch_run

COMMIT = "c0ffee" + "0" * 34
DEAD_ENDPOINT = "http://127.0.0.1:9"  # discard port: nothing here may reach a network


@pytest.fixture(autouse=True)
def _own_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads or fills the user's Hugging Face cache."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))


def run_cli(*args: str, env: dict[str, str] | None = None) -> Result:
    from prepkit.cli import cli

    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def _response(status: int) -> httpx2.Response:
    return httpx2.Response(status, request=httpx2.Request("GET", f"{DEAD_ENDPOINT}/api/models/x"))


@pytest.fixture()
def src(tmp_path: Path) -> Path:
    """A tiny repo: config, an index naming two shards, the two shards, and a tokenizer."""
    root = tmp_path / "hub"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    shards = ["model-00000-of-00001.safetensors", "model-00001-of-00001.safetensors"]
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 2}, "weight_map": {"a": shards[0], "b": shards[1]}})
    )
    for i, name in enumerate(shards):
        (root / name).write_bytes(bytes([i + 1]) * (1000 + i))
    (root / "tokenizer.json").write_text("{}")
    return root


def _remote(src: Path) -> list[fetching.RemoteFile]:
    files = []
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        data = path.read_bytes()
        name = path.relative_to(src).as_posix()
        if name.endswith(".safetensors"):
            files.append(fetching.RemoteFile(name, len(data), hashlib.sha256(data).hexdigest(), None))
        else:
            blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
            files.append(fetching.RemoteFile(name, len(data), None, blob))
    return files


Downloader = Callable[..., str]


@dataclass
class FakeHub:
    """The listing comes from ``src``; ``snapshot_download`` fetches each matching file through
    ``download`` (default: ``copy``), in order, and stops at the first error, as the library does."""

    src: Path
    calls: list[str] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)  # force_download, per call of snapshot_download
    download: Downloader | None = None

    def copy(self, repo_id: str, filename: str, *, local_dir: Path, bar: Any = None, **_: Any) -> str:
        data = (self.src / filename).read_bytes()
        target = Path(local_dir) / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        if bar is not None:  # in two steps, like a streamed body
            bar.update(len(data) // 2)
            bar.update(len(data) - len(data) // 2)
        return str(target)

    def __call__(self, repo_id: str, *, allow_patterns: list[str], tqdm_class: Any = None, **kwargs: Any) -> str:
        from huggingface_hub.utils import filter_repo_objects

        self.forced.append(bool(kwargs.get("force_download")))
        bar = tqdm_class(total=0, unit="B") if tqdm_class else None
        names = sorted(p.relative_to(self.src).as_posix() for p in self.src.rglob("*") if p.is_file())
        for name in filter_repo_objects(names, allow_patterns=allow_patterns):
            self.calls.append(name)
            (self.download or self.copy)(repo_id, name, local_dir=kwargs["local_dir"], bar=bar)
        return str(kwargs["local_dir"])


@pytest.fixture()
def fake_hub(src: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    hub = FakeHub(src)

    def listing(source: fetching.Source, **_: Any) -> tuple[str, list[fetching.RemoteFile]]:
        return COMMIT, _remote(src)

    monkeypatch.setattr(fetch_hub, "list_remote", listing)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    return hub


def _plan(dest: Path, repo: str = "someorg/model") -> fetching.FetchPlan:
    return fetching.plan_fetch(fetching.Source(repo, COMMIT), dest, endpoint=DEAD_ENDPOINT)


# ------------------------------------------------------------------------ sources and folders


def test_recipe_names_pin_the_recipe_revision() -> None:
    for name in ("gpt-oss-120b", "openai/gpt-oss-120b"):
        source = fetching.resolve_source(name)
        assert source.repo_id == "openai/gpt-oss-120b"
        assert source.revision == "b5c939de8f754692c1647ca79fbf85e8c1e70f8a"
        assert source.recipe == "gpt-oss-120b"
    assert fetching.resolve_source("gpt-oss-20b").revision == "6cee5e81ee83917806bbde320786a8fb61efebee"
    assert fetching.resolve_source("gpt-oss-20b", revision="main").revision == "main"


def test_other_repos_default_to_main_and_bad_names_are_refused() -> None:
    source = fetching.resolve_source("someorg/some-model")
    assert (source.repo_id, source.revision, source.recipe) == ("someorg/some-model", "main", None)
    for bad in ("not-a-model", "a/b/c", "/x", "missing.json"):
        with pytest.raises(RecipeError):
            fetching.resolve_source(bad)


def test_default_patterns_skip_original_and_metal() -> None:
    paths = [
        "config.json",
        "model-00000-of-00001.safetensors",
        "original/model--00001-of-00007.safetensors",
        "original/config.json",
        "metal/model.bin",
        "README.md",
        "chat_template.jinja",
    ]
    remote = [fetching.RemoteFile(p, 1, None, "x") for p in paths]
    source = fetching.resolve_source("gpt-oss-120b")
    from huggingface_hub.utils import filter_repo_objects  # the matcher the plan uses

    def pick(original: bool) -> list[str]:
        include, exclude = source.patterns(original)
        chosen = filter_repo_objects(remote, allow_patterns=include, ignore_patterns=exclude, key=lambda f: f.path)
        return sorted(f.path for f in chosen)

    assert pick(False) == ["chat_template.jinja", "config.json", "model-00000-of-00001.safetensors"]
    assert pick(True) == pick(False) + ["original/config.json", "original/model--00001-of-00007.safetensors"]
    assert not any(p.startswith("metal/") for p in pick(True))


def test_prepare_finds_the_model_in_the_hub_cache(tmp_path: Path) -> None:
    from prepkit.constants import INDEX_NAME
    from prepkit.recipes import load_recipe

    recipe = load_recipe("gpt-oss-120b")
    repo = tmp_path / "hf-cache" / "models--openai--gpt-oss-120b"  # huggingface_hub's layout, as `hf download` left it
    snapshot = repo / "snapshots" / recipe.revision
    assert fetching.default_model_dir(recipe) == snapshot  # nothing there: where fetch would put it
    snapshot.mkdir(parents=True)
    (snapshot / INDEX_NAME).write_text("{}")
    assert fetching.default_model_dir(recipe) == snapshot

    # A branch is found through refs/<branch>, as huggingface_hub writes it.
    commit = "ab" * 20
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir()
    (repo / "snapshots" / commit / INDEX_NAME).write_text("{}")
    assert fetching.find_model_dir("openai/gpt-oss-120b", "main") == repo / "snapshots" / commit


def test_fetch_record_absent_or_malformed(tmp_path: Path) -> None:
    assert fetching.read_fetch_record(tmp_path) is None
    (tmp_path / FETCH_RECORD).write_text("{not json")
    with pytest.raises(FetchError, match="unreadable"):
        fetching.read_fetch_record(tmp_path)
    (tmp_path / FETCH_RECORD).write_text(json.dumps({"format": "something-else/9"}))
    with pytest.raises(FetchError, match="not a prepkit fetch record"):
        fetching.read_fetch_record(tmp_path)


# ------------------------------------------------------------------ download with the fake hub


def test_fetch_verifies_records_and_reports_progress(fake_hub: FakeHub, src: Path, tmp_path: Path) -> None:
    seen: list[tuple[str, int, int]] = []
    result = fetching.fetch(
        _plan(tmp_path / "m"), on_progress=lambda label, done, total: seen.append((label, done, total))
    )
    sizes = {p.name: p.stat().st_size for p in src.iterdir()}
    assert set(result.downloaded) == set(sizes)
    total = sum(sizes.values())
    # One total, as huggingface_hub counts the bytes of all its transfers together; never backwards.
    assert {label for label, _, _ in seen} == {fetching.TOTAL_LABEL}
    assert seen[0][1:] == (0, total) and seen[-1][1:] == (total, total)
    assert [done for _, done, _ in seen] == sorted(done for _, done, _ in seen)
    record = fetching.read_fetch_record(tmp_path / "m")
    assert record is not None and record.commit == COMMIT
    assert {e.path: e.sha256 for e in record.entries} == {
        n: hashlib.sha256((src / n).read_bytes()).hexdigest() for n in sizes
    }


def test_a_small_file_is_checked_against_its_git_blob_id(fake_hub: FakeHub, tmp_path: Path) -> None:
    def wrong_config(repo_id: str, filename: str, *, local_dir: Path, **kwargs: Any) -> str:
        path = fake_hub.copy(repo_id, filename, local_dir=local_dir, **kwargs)
        if filename == "config.json":  # same size, one byte off
            Path(path).write_text(json.dumps({"model_type": "gpt_osx"}))
        return path

    fake_hub.download = wrong_config
    with pytest.raises(FetchError, match=r"failed hash verification twice.*config\.json"):
        fetching.fetch(_plan(tmp_path / "m"))
    assert fake_hub.calls.count("config.json") == 2
    assert not (tmp_path / "m" / "config.json").exists()


def test_index_naming_a_shard_the_repo_lacks_is_refused(fake_hub: FakeHub, src: Path, tmp_path: Path) -> None:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["c"] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FetchError, match="model-00002-of-00002.safetensors"):
        fetching.fetch(_plan(tmp_path / "m"))
    assert fetching.read_fetch_record(tmp_path / "m") is None


def fetch_cli(dest: Path, *extra: str, env: dict[str, str] | None = None) -> Result:
    return run_cli(
        "fetch",
        "--model",
        "someorg/model",
        "--revision",
        COMMIT,
        "--local-dir",
        str(dest),
        "--endpoint",
        DEAD_ENDPOINT,
        *extra,
        env=env,
    )


def test_transfer_breaking_off_leaves_nothing_complete_and_the_rerun_fetches_the_rest(
    fake_hub: FakeHub, tmp_path: Path
) -> None:
    dest = tmp_path / "m"
    shard = "model-00001-of-00001.safetensors"

    def broken(repo_id: str, filename: str, *, local_dir: Path, **kwargs: Any) -> str:
        if filename != shard:
            return fake_hub.copy(repo_id, filename, local_dir=local_dir, **kwargs)
        # huggingface_hub streams into a partial file under another name, which it deletes on an error.
        raise httpx2.RemoteProtocolError("peer closed connection without sending complete message body")

    fake_hub.download = broken
    result = fetch_cli(dest, "--max-workers", "1")
    assert result.exit_code == FetchError.exit_code
    assert "broke off" in result.stderr and shard in result.stderr and "again" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (dest / shard).exists()
    assert not (dest / FETCH_RECORD).exists()

    fake_hub.download = None
    fake_hub.calls.clear()
    result = fetch_cli(dest, "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert shard in summary["downloaded"]
    assert set(fake_hub.calls) == set(summary["downloaded"])  # finished files were not fetched again


def test_disk_full_mid_download(fake_hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    shard = "model-00000-of-00001.safetensors"

    def full(repo_id: str, filename: str, **kwargs: Any) -> str:
        if filename == shard:
            raise OSError(errno.ENOSPC, "No space left on device")
        return fake_hub.copy(repo_id, filename, **kwargs)

    fake_hub.download = full
    result = fetch_cli(dest, "--max-workers", "1")
    assert result.exit_code == FetchError.exit_code
    # The library's parallel download does not say which file hit the full disk: the repo is named.
    assert "disk full while writing someorg/model" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (dest / shard).exists()
    assert not (dest / FETCH_RECORD).exists()


def test_server_error_on_a_file(fake_hub: FakeHub, tmp_path: Path) -> None:
    def unavailable(repo_id: str, filename: str, **kwargs: Any) -> str:
        raise hf_errors.HfHubHTTPError("503 Service Unavailable", response=_response(503))

    fake_hub.download = unavailable
    result = fetch_cli(tmp_path / "m")
    assert result.exit_code == FetchError.exit_code
    assert "HTTP 503" in result.stderr and "again" in result.stderr
    assert len(fake_hub.calls) == 1  # a server error is not retried: the hint says to rerun


def test_a_second_fetch_into_the_same_folder_is_refused_with_the_holders_pid(fake_hub: FakeHub, tmp_path: Path) -> None:
    import subprocess
    import sys

    dest = tmp_path / "m"
    hold = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from prepkit.locks import exclusive\n"
        "with exclusive(Path(sys.argv[1]), busy=lambda pid: RuntimeError(pid)):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(dest / fetch_run.LOCK_PATH)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        result = fetch_cli(dest)
    finally:
        holder.kill()
        holder.wait()
    assert result.exit_code == 3  # busy, as for prepare and tactics merge
    assert f"another prepkit fetch (pid {holder.pid}) is writing {dest}" in result.stderr
    assert "Traceback" not in result.stderr
    assert fake_hub.calls == []
    # The lock goes with its holder: nothing stale is left to refuse the next run.
    assert fetch_cli(dest).exit_code == 0


def test_the_hf_download_spellings_are_the_only_ones(fake_hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    args = ["fetch", "--model", "someorg/model", "--revision", COMMIT, "--endpoint", DEAD_ENDPOINT]
    result = run_cli(*args, "--local-dir", str(dest), "--max-workers", "1", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["dir"] == str(dest.resolve())
    for old in (["--dir", str(tmp_path / "old")], ["--workers", "1"]):
        refused = run_cli(*args, *old)
        assert refused.exit_code == 2 and f"No such option '{old[0]}'" in refused.stderr
    assert not (tmp_path / "old").exists()
    shown = run_cli("fetch", "--help").stdout
    for new in ("--local-dir", "--max-workers", "--include", "--exclude", "--token", "--revision", "--cache-dir"):
        assert new in shown
    for old in ("--dir ", "--workers"):
        assert old not in shown
    assert "hf download" in shown  # -q is documented against hf's meaning


def test_include_and_exclude_choose_the_files_like_hf_download(fake_hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    args = ["fetch", "--model", "gpt-oss-120b", "--revision", COMMIT, "--endpoint", DEAD_ENDPOINT]
    result = run_cli(*args, "--local-dir", str(dest), "--include", "*.json", "--exclude", "tokenizer*", "--json")
    assert result.exit_code == 0, result.stderr
    # Only what was asked: no shards (so no index completeness check), no tokenizer.
    assert sorted(json.loads(result.stdout)["downloaded"]) == ["config.json", "model.safetensors.index.json"]
    assert sorted(fake_hub.calls) == ["config.json", "model.safetensors.index.json"]


def test_quiet_prints_only_the_folder(fake_hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    result = fetch_cli(dest, "-q")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{dest.resolve()}\n"
    assert result.stderr == ""


def test_each_file_is_read_once_and_lfs_files_get_no_git_blob_id(
    fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed: list[tuple[str, Any]] = []
    real_verify_file = fetch_record.verify_file

    def recording(dest: Path, remote: fetching.RemoteFile) -> Any:
        entry = real_verify_file(dest, remote)
        hashed.append((remote.path, entry))
        return entry

    monkeypatch.setattr(fetch_record, "verify_file", recording)
    result = fetching.fetch(_plan(tmp_path / "m"))
    assert sorted(name for name, _ in hashed) == sorted(f.path for f in result.plan.files)
    lfs = {f.path for f in result.plan.files if f.remote.sha256 is not None}
    assert lfs and len(lfs) < len(hashed)
    for name, entry in hashed:
        assert (entry.git_blob is None) == (name in lfs), name
    # A rerun trusts what it verified (same size and mtime): nothing is read again.
    hashed.clear()
    fetching.fetch(_plan(tmp_path / "m"))
    assert hashed == []


# ------------------------------------------------------------------------- listing errors


def _hub_api_raising(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    def raise_it(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise error

    for name in ("repo_info", "list_repo_tree", "list_repo_refs"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, raise_it)


@pytest.mark.parametrize(
    ("error", "message", "hint"),
    [
        (hf_errors.GatedRepoError("gated", response=_response(403)), "is gated", "HF_TOKEN"),
        (hf_errors.RevisionNotFoundError("nope", response=_response(404)), "revision 'main' not found", "--revision"),
        (hf_errors.RepositoryNotFoundError("nope", response=_response(401)), "not found at", "HF_TOKEN"),
        (hf_errors.HfHubHTTPError("boom", response=_response(500)), "HTTP 500", "again"),
        (httpx2.ConnectError("connection refused"), "cannot reach", "--offline"),
    ],
)
def test_listing_errors_are_one_clear_message(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, error: Exception, message: str, hint: str
) -> None:
    _hub_api_raising(monkeypatch, error)
    dest = tmp_path / "m"
    result = run_cli("fetch", "--model", "someorg/model", "--local-dir", str(dest), "--endpoint", DEAD_ENDPOINT)
    assert result.exit_code == FetchError.exit_code
    assert message in result.stderr
    assert hint in result.stderr
    assert "Traceback" not in result.stderr
    assert not dest.exists()


def test_progress_reaches_a_log_as_lines_for_the_total(fake_hub: FakeHub, tmp_path: Path) -> None:
    from prepkit.console import PROGRESS_INTERVAL_ENV

    # CliRunner's stderr is not a terminal: lines, not bars; the total only, not one per file
    result = fetch_cli(tmp_path / "m", "--max-workers", "1", env={PROGRESS_INTERVAL_ENV: "0"})
    assert result.exit_code == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "elapsed" in line]
    assert lines and all(line.startswith(f"{fetching.TOTAL_LABEL}: ") for line in lines)
    assert "(100%)" in lines[-1]
    quiet = fetch_cli(tmp_path / "q", "-q", env={PROGRESS_INTERVAL_ENV: "0"})
    assert quiet.exit_code == 0 and "elapsed" not in quiet.stderr


# ------------------------------------------------------------------------- options like hf download


def test_the_repo_id_may_be_given_as_an_argument(fake_hub: FakeHub, tmp_path: Path) -> None:
    common = ["--revision", COMMIT, "--endpoint", DEAD_ENDPOINT, "--json"]
    result = run_cli("fetch", "someorg/model", "--local-dir", str(tmp_path / "m"), *common)
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["repo_id"] == "someorg/model" and set(summary["downloaded"]) == set(fake_hub.calls)
    # A recipe name works as for --model, and the same name twice is no conflict.
    same = run_cli("fetch", "gpt-oss-120b", "--model", "gpt-oss-120b", "--local-dir", str(tmp_path / "r"), *common)
    assert same.exit_code == 0, same.stderr
    assert json.loads(same.stdout)["repo_id"] == "openai/gpt-oss-120b"
    clash = run_cli("fetch", "someorg/model", "--model", "gpt-oss-20b", "--local-dir", str(tmp_path / "x"))
    assert clash.exit_code == 2 and "disagree" in clash.stderr
    assert not (tmp_path / "x").exists()
    empty = run_cli("fetch", "", "--local-dir", str(tmp_path / "x"))  # not the default model in disguise
    assert empty.exit_code == 3 and "no recipe ''" in empty.stderr


def test_force_download_fetches_verified_files_again(fake_hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    assert fetch_cli(dest).exit_code == 0
    fake_hub.calls.clear()
    dry = json.loads(fetch_cli(dest, "--force-download", "--dry-run", "--json").stdout)
    assert {f["status"] for f in dry["files"]} == {"forced"} and dry["force_download"] is True
    result = fetch_cli(dest, "--force-download", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert sorted(summary["downloaded"]) == sorted(fake_hub.calls) == sorted(f["path"] for f in dry["files"])
    assert fake_hub.forced[-1] is True and summary["reused"] == []
    refused = fetch_cli(dest, "--force-download", "--offline")
    assert refused.exit_code == 2 and "--offline" in refused.stderr
    refused = fetch_cli(dest, "--force-download", env={"HF_HUB_OFFLINE": "1"})
    assert refused.exit_code == FetchError.exit_code and "HF_HUB_OFFLINE" in refused.stderr


def test_hf_hub_offline_never_asks_the_hub(fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    dest = tmp_path / "m"
    assert fetch_cli(dest).exit_code == 0
    _hub_api_raising(monkeypatch, AssertionError("the hub was asked under HF_HUB_OFFLINE=1"))
    result = fetch_cli(dest, "--json", env={"HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["downloaded"] == []
    start = time.monotonic()
    never = fetch_cli(tmp_path / "never", env={"HF_HUB_OFFLINE": "1"})
    assert never.exit_code == FetchError.exit_code and "no earlier fetch" in never.stderr
    assert time.monotonic() - start < 5


def test_no_network_fails_within_seconds_even_for_a_commit(tmp_path: Path) -> None:
    """The tree listing retries a dead connection for half a minute; the repo_info asked first does not."""
    import socket
    import time

    with socket.socket() as sock:  # a port nobody listens on: connections are refused at once
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    start = time.monotonic()
    result = run_cli(
        "fetch", "someorg/model", "--revision", COMMIT, "--local-dir", str(tmp_path / "m"), "--endpoint", dead
    )
    assert time.monotonic() - start < 5
    assert result.exit_code == FetchError.exit_code
    assert f"cannot reach {dead}" in result.stderr and "--offline" in result.stderr
    assert "Traceback" not in result.stderr


def test_prepkit_uses_only_the_public_api_of_huggingface_hub() -> None:
    """The library's private layout and helpers may change in any minor release: prepkit imports only
    names the package exports, or its public errors, constants and utils modules."""
    import ast

    public_modules = {"huggingface_hub.errors", "huggingface_hub.constants", "huggingface_hub.utils"}
    root = Path(fetching.__file__).resolve().parent.parent
    used = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("huggingface_hub"):
                used += [(path.relative_to(root).as_posix(), node.module, alias.name) for alias in node.names]
    assert used, "no import of huggingface_hub found: the scan is broken"
    for where, module, name in used:
        if module == "huggingface_hub":
            public = name in huggingface_hub.__all__ or name in ("constants", "errors", "utils")
        else:
            public = module in public_modules and not name.startswith("_")
        assert public, f"{where} imports {name} from {module}"

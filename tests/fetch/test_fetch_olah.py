"""``prepkit fetch`` against a real HF-compatible server: olah, offline, on 127.0.0.1.

The server serves a small synthetic gpt-oss checkpoint from git repos with LFS pointers (built by
``olah_server.build_mirror_repo``), once under the real name ``openai/gpt-oss-120b`` (so the recipe
path is exercised; ``--revision main`` replaces the pinned commit, which olah does not have) and
under test names for the corruption cases.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from prepkit import fetch as fetching
from prepkit.constants import FETCH_RECORD
from prepkit.data import recipes_dir
from prepkit.errors import FetchError
from prepkit.fetch.source import DEFAULT_INCLUDE

try:  # tests/ is a package here; without its __init__.py pytest puts tests/ itself on sys.path
    from tests.fetch import olah_server
except ModuleNotFoundError:
    import olah_server  # type: ignore[no-redef]

OLAH_CLI = olah_server.find_olah_cli()
_MISSING = [name for name, ok in (("olah-cli", OLAH_CLI), ("git", shutil.which("git"))) if not ok]
if _MISSING and os.environ.get("PREPKIT_REQUIRE_OLAH") == "1":
    raise RuntimeError(f"PREPKIT_REQUIRE_OLAH=1 but {', '.join(_MISSING)} not found (see .ci/run)")
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)}")

REPO = "openai/gpt-oss-120b"
PLAIN_REPO = "testorg/tiny-gpt-oss"
CORRUPT_REPO = "testorg/corrupt-gpt-oss"
FLAKY_REPO = "testorg/flaky-gpt-oss"
MOVING_REPO = "testorg/moving-gpt-oss"  # gets a new commit during a test
BIG_REPO = "testorg/big-gpt-oss"  # one shard large enough to interrupt while it streams
BIG_SHARD = "model-00000-of-00002.safetensors"
BIG_SHARD_BYTES = 16 * 2**20
SHARD = "model-00001-of-00002.safetensors"
DEFAULT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "model-00000-of-00002.safetensors",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}


@dataclass(frozen=True)
class Hub:
    endpoint: str
    src: Path  # the checkpoint as it is in the repos, with real bytes
    repos: dict[str, olah_server.MirrorRepo]

    def sha256(self, path: str) -> str:
        return hashlib.sha256((self.src / path).read_bytes()).hexdigest()


def _write_source(root: Path) -> Path:
    from prepkit.synth import write_synthetic_checkpoint

    # Small dims keep the whole repo under 1 MB; 3 shards so a rerun can lose one of several.
    src = write_synthetic_checkpoint(root, hidden=64, intermediate=64, num_shards=3, vocab_size=256)
    (src / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 131072}))
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}\n")
    (src / "README.md").write_text("# synthetic gpt-oss\n")
    (src / "original").mkdir()
    (src / "original" / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    (src / "original" / "model.safetensors").write_bytes(os.urandom(4096))
    (src / "metal").mkdir()
    (src / "metal" / "model.bin").write_bytes(os.urandom(4096))
    return src


def _corrupt_object(repo: olah_server.MirrorRepo, data: bytes) -> bytes:
    """Same size, different bytes: what a bad proxy or disk would serve. Returns the good bytes."""
    obj = repo.lfs_object(hashlib.sha256(data).hexdigest())
    good = obj.read_bytes()
    obj.write_bytes(bytes(b ^ 0xFF for b in good[:64]) + good[64:])
    return good


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    assert OLAH_CLI is not None
    work = tmp_path_factory.mktemp("olah")
    src = _write_source(work / "src")
    mirrors = work / "mirrors"
    repos = {
        name: olah_server.build_mirror_repo(src, mirrors, name)
        for name in (REPO, PLAIN_REPO, CORRUPT_REPO, FLAKY_REPO, MOVING_REPO)
    }
    _corrupt_object(repos[CORRUPT_REPO], (src / SHARD).read_bytes())
    big = work / "big"
    shutil.copytree(src, big)
    (big / BIG_SHARD).write_bytes(os.urandom(BIG_SHARD_BYTES))
    repos[BIG_REPO] = olah_server.build_mirror_repo(big, mirrors, BIG_REPO)
    with olah_server.serve(mirrors, work, probe_repo=REPO, olah_cli=OLAH_CLI) as endpoint:
        yield Hub(endpoint=endpoint, src=src, repos=repos)


@pytest.fixture(autouse=True)
def _own_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads or fills the user's Hugging Face cache."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))


def run_cli(*args: str, env: dict[str, str] | None = None) -> Result:
    from prepkit.cli import cli

    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def fetch_args(hub: Hub, dest: Path | None, *extra: str, repo: str = REPO) -> list[str]:
    where = ["--local-dir", str(dest)] if dest is not None else []
    return ["fetch", "--model", repo, "--revision", "main", *where, "--endpoint", hub.endpoint, *extra]


def files_under(dest: Path) -> set[str]:
    return {
        p.relative_to(dest).as_posix()
        for p in dest.rglob("*")
        if p.is_file() and ".cache" not in p.relative_to(dest).parts
    }


def assert_identical(hub: Hub, dest: Path, names: set[str]) -> None:
    for name in names:
        assert (dest / name).read_bytes() == (hub.src / name).read_bytes(), name


def test_dry_run_plans_only_the_needed_files_and_writes_nothing(hub: Hub, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    result = run_cli(*fetch_args(hub, dest, "--dry-run", "--json"))
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["dry_run"] is True
    assert plan["commit"] == hub.repos[REPO].commit
    assert plan["recipe"] == "gpt-oss-120b"
    sizes = {f["path"]: f["size"] for f in plan["files"]}
    assert set(sizes) == DEFAULT_FILES  # no original/, no metal/, no README
    assert sizes == {name: (hub.src / name).stat().st_size for name in DEFAULT_FILES}
    assert {f["status"] for f in plan["files"]} == {"missing"}
    assert plan["download_bytes"] == sum(sizes.values())
    assert not dest.exists()


def test_fetch_downloads_verifies_and_records(hub: Hub, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    result = run_cli(*fetch_args(hub, dest, "--json"))
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert sorted(summary["downloaded"]) == sorted(DEFAULT_FILES)
    assert summary["reused"] == [] and summary["retried"] == []
    assert files_under(dest) == DEFAULT_FILES | {FETCH_RECORD}
    assert_identical(hub, dest, DEFAULT_FILES)
    assert not list(dest.rglob("*.incomplete"))

    record = fetching.read_fetch_record(dest)
    assert record is not None
    assert (record.repo_id, record.revision, record.commit) == (REPO, "main", hub.repos[REPO].commit)
    assert {e.path: e.sha256 for e in record.entries} == {name: hub.sha256(name) for name in DEFAULT_FILES}
    shards = {n for n in DEFAULT_FILES if n.endswith(".safetensors")}
    assert {e.path for e in record.entries if e.lfs} == shards


def test_rerun_downloads_nothing(hub: Hub, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    assert run_cli(*fetch_args(hub, dest)).exit_code == 0
    mtimes = {name: (dest / name).stat().st_mtime_ns for name in DEFAULT_FILES}
    result = run_cli(*fetch_args(hub, dest, "--json"))
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["downloaded"] == []
    assert sorted(summary["reused"]) == sorted(DEFAULT_FILES)
    assert {name: (dest / name).stat().st_mtime_ns for name in DEFAULT_FILES} == mtimes


def test_rerun_after_interruption_fetches_only_what_is_missing_or_bad(hub: Hub, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    assert run_cli(*fetch_args(hub, dest)).exit_code == 0
    # What an interrupted or damaged run leaves behind: a missing shard, a truncated one, one with
    # the right size but wrong bytes.
    (dest / "model-00000-of-00002.safetensors").unlink()
    with (dest / "model-00001-of-00002.safetensors").open("r+b") as fh:
        fh.truncate(1000)
    bad = dest / "model-00002-of-00002.safetensors"
    bad.write_bytes(b"\0" * bad.stat().st_size)

    dry = json.loads(run_cli(*fetch_args(hub, dest, "--dry-run", "--json")).stdout)
    status = {f["path"]: f["status"] for f in dry["files"]}
    assert status["model-00000-of-00002.safetensors"] == "missing"
    assert status["model-00001-of-00002.safetensors"] == "wrong-size"
    assert status["model-00002-of-00002.safetensors"] == "unverified"
    assert status["config.json"] == "verified"

    result = run_cli(*fetch_args(hub, dest, "--json"))
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert sorted(summary["downloaded"]) == [f"model-0000{i}-of-00002.safetensors" for i in range(3)]
    assert_identical(hub, dest, DEFAULT_FILES)
    assert fetching.read_fetch_record(dest) is not None


def test_include_original_adds_original_but_never_metal(hub: Hub, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    result = run_cli(*fetch_args(hub, dest, "--include-original", "--json"))
    assert result.exit_code == 0, result.stderr
    expected = DEFAULT_FILES | {"original/config.json", "original/model.safetensors"}
    assert files_under(dest) == expected | {FETCH_RECORD}
    assert_identical(hub, dest, expected)
    record = fetching.read_fetch_record(dest)
    assert record is not None and record.include_original


def test_plain_org_repo_without_recipe(hub: Hub, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    result = run_cli(*fetch_args(hub, dest, "--json", repo=PLAIN_REPO))
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["commit"] == hub.repos[PLAIN_REPO].commit
    assert set(summary["downloaded"]) == DEFAULT_FILES
    record = fetching.read_fetch_record(dest)
    assert record is not None and record.recipe is None and record.repo_id == PLAIN_REPO


def test_default_store_is_the_hub_cache(hub: Hub, tmp_path: Path) -> None:
    result = run_cli("fetch", "--model", PLAIN_REPO, "--endpoint", hub.endpoint)
    assert result.exit_code == 0, result.stderr
    repo = tmp_path / "hf-cache" / "models--testorg--tiny-gpt-oss"
    commit = hub.repos[PLAIN_REPO].commit
    snapshot = repo / "snapshots" / commit
    assert result.stdout.strip() == str(snapshot)
    assert (repo / "refs" / "main").read_text() == commit
    assert (snapshot / FETCH_RECORD).is_file()
    assert_identical(hub, snapshot, DEFAULT_FILES)
    # huggingface_hub's layout: every file a link to its blob, named by its hash.
    for name in DEFAULT_FILES:
        blob = (snapshot / name).resolve()
        assert (snapshot / name).is_symlink() and blob.parent == repo / "blobs"
        if name.endswith(".safetensors"):
            assert blob.name == hub.sha256(name)
    assert not list(tmp_path.rglob("*.incomplete")) and not list(tmp_path.rglob("*.tmp-*"))


class _Requests:
    """Every HTTP request huggingface_hub sends (it talks through httpx2), by URL."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import httpx2

        self.sent: list[tuple[str, str]] = []
        real_send = httpx2.Client.send

        def send(client: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            self.sent.append((request.method, str(request.url)))
            return real_send(client, request, *args, **kwargs)

        monkeypatch.setattr(httpx2.Client, "send", send)

    @property
    def file_requests(self) -> list[tuple[str, str]]:
        """Requests for a file (HEAD for its metadata, GET for its bytes), not for the repo's listing."""
        return [(method, url) for method, url in self.sent if "/resolve/" in url]


def _hf_snapshot(hub: Hub, repo: str, **where: Any) -> Path:
    import huggingface_hub

    patterns = list(DEFAULT_INCLUDE)
    path = huggingface_hub.snapshot_download(
        repo, revision="main", endpoint=hub.endpoint, allow_patterns=patterns, **where
    )
    return Path(path)


def test_a_model_already_in_the_hub_cache_downloads_nothing(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = _hf_snapshot(hub, REPO, cache_dir=tmp_path / "hf-cache")  # what `hf download` leaves
    assert_identical(hub, snapshot, DEFAULT_FILES)
    requests = _Requests(monkeypatch)
    result = run_cli(*fetch_args(hub, None, "--json"))
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["dir"] == str(snapshot)
    assert summary["downloaded"] == [] and summary["downloaded_bytes"] == 0
    assert sorted(summary["reused"]) == sorted(DEFAULT_FILES)
    assert requests.sent, "the plan asks the hub for the commit and the file list"
    assert requests.file_requests == []  # and nothing about any file: not even a HEAD
    record = fetching.read_fetch_record(snapshot)
    assert record is not None and {e.path: e.sha256 for e in record.entries} == {
        n: hub.sha256(n) for n in DEFAULT_FILES
    }

    # `prepare --model` finds it there (a recipe that pins main, as olah has not the real commit).
    recipe = json.loads((recipes_dir() / "gpt-oss-120b.json").read_text())
    recipe_path = tmp_path / "recipe.json"
    recipe_path.write_text(json.dumps(recipe | {"revision": "main"}))
    out = tmp_path / "prepared"
    result = run_cli("prepare", "--model", str(recipe_path), "--tp", "1", "--out", str(out), "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["provenance"] == "prepkit fetch"
    assert record.commit in (out / "manifest.json").read_text()


def test_verify_src_from_cache_compares_with_the_snapshot_the_manifest_names(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert run_cli(*fetch_args(hub, None)).exit_code == 0  # into the Hugging Face cache
    recipe = json.loads((recipes_dir() / "gpt-oss-120b.json").read_text())
    recipe_path = tmp_path / "recipe.json"
    recipe_path.write_text(json.dumps(recipe | {"revision": "main"}))  # olah has not the pinned commit
    out = tmp_path / "prepared"
    assert run_cli("prepare", "--model", str(recipe_path), "--tp", "1", "--out", str(out), "-q").exit_code == 0

    result = run_cli("verify", str(out), "--src-from-cache", "--sample", "1", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["experts_checked"] > 0 and report["shared_tensors_checked"] > 0

    both = run_cli("verify", str(out), "--src", str(tmp_path), "--src-from-cache")
    assert both.exit_code == 2 and "give one of them" in both.stderr

    commit = hub.repos[REPO].commit
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    missing = run_cli("verify", str(out), "--src-from-cache")
    assert missing.exit_code == 3, missing.stderr
    assert "has no snapshot" in missing.stderr and f"prepkit fetch {REPO} --revision {commit}" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_an_hf_download_local_dir_folder_is_reused(hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = _hf_snapshot(hub, REPO, local_dir=tmp_path / "model")
    bad = dest / "model-00002-of-00002.safetensors"
    bad.write_bytes(b"\0" * bad.stat().st_size)  # right size, wrong bytes: only the hash can tell
    requests = _Requests(monkeypatch)
    result = run_cli(*fetch_args(hub, dest, "--json"))
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["downloaded"] == [bad.name]
    assert sorted(summary["reused"]) == sorted(DEFAULT_FILES - {bad.name})
    assert [u.rsplit("/", 1)[-1] for m, u in requests.file_requests if m == "GET"] == [bad.name]
    assert_identical(hub, dest, DEFAULT_FILES)


def test_a_bad_blob_in_the_cache_is_replaced_not_linked_again(hub: Hub, tmp_path: Path) -> None:
    snapshot = _hf_snapshot(hub, REPO, cache_dir=tmp_path / "hf-cache")
    blob = (snapshot / SHARD).resolve()
    blob.write_bytes(b"\0" * blob.stat().st_size)
    (snapshot / SHARD).unlink()  # only the blob is left: the plan links it, the hash refuses it
    result = run_cli(*fetch_args(hub, None, "--dry-run", "--json"))
    assert {f["path"]: f["status"] for f in json.loads(result.stdout)["files"]}[SHARD] == "cached"
    result = run_cli(*fetch_args(hub, None, "--json"))
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["downloaded"] == [SHARD]
    assert (snapshot / SHARD).read_bytes() == (hub.src / SHARD).read_bytes()
    assert (snapshot / SHARD).resolve() == blob and blob.read_bytes() == (hub.src / SHARD).read_bytes()


def test_shard_corrupt_on_the_server_is_fetched_twice_then_reported(hub: Hub, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    result = run_cli(*fetch_args(hub, dest, repo=CORRUPT_REPO))
    assert result.exit_code == FetchError.exit_code
    assert "failed hash verification twice" in result.stderr and SHARD in result.stderr
    assert "Traceback" not in result.stderr
    assert not (dest / SHARD).exists()  # never left under its final name
    assert not (dest / FETCH_RECORD).exists()
    assert_identical(hub, dest, DEFAULT_FILES - {SHARD})  # the others completed


def test_transient_corruption_is_healed_by_the_retry(hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    repo = hub.repos[FLAKY_REPO]
    good = _corrupt_object(repo, (hub.src / SHARD).read_bytes())
    real_download = huggingface_hub.snapshot_download
    calls: list[list[str]] = []

    def download_then_repair(repo_id: str, **kwargs: Any) -> Any:
        path = real_download(repo_id, **kwargs)
        calls.append(list(kwargs["allow_patterns"]))
        if SHARD in calls[-1]:  # the server serves good bytes from now on
            repo.lfs_object(hub.sha256(SHARD)).write_bytes(good)
        return path

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download_then_repair)
    dest = tmp_path / "model"
    result = run_cli(*fetch_args(hub, dest, "--json", repo=FLAKY_REPO))
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["retried"] == [SHARD]
    assert calls[1:] == [[SHARD]]  # the second download asks for the failed file only
    assert_identical(hub, dest, DEFAULT_FILES)


def test_offline_checks_a_complete_folder_and_refuses_an_incomplete_one(hub: Hub, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    assert run_cli(*fetch_args(hub, dest)).exit_code == 0
    offline = ["fetch", "--model", REPO, "--revision", "main", "--local-dir", str(dest), "--offline", "--json"]
    # An endpoint nobody listens on: --offline must not need it.
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{olah_server.free_port()}"}
    result = run_cli(*offline, env=env)
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["downloaded"] == []

    other = "model-00000-of-00002.safetensors"
    (dest / SHARD).unlink()
    (dest / other).unlink()
    result = run_cli(*offline, env=env)
    assert result.exit_code == FetchError.exit_code
    assert "--offline" in result.stderr and "incomplete" in result.stderr
    assert SHARD in result.stderr and other in result.stderr  # every missing file, in one message
    assert not (dest / FETCH_RECORD).exists()  # the folder no longer looks complete

    assert run_cli(*fetch_args(hub, dest)).exit_code == 0
    bad = dest / "model-00002-of-00002.safetensors"
    bad.write_bytes(b"\0" * bad.stat().st_size)  # right size, wrong bytes: only the hash can tell
    result = run_cli(*offline, env=env)
    assert result.exit_code == FetchError.exit_code
    assert "do not match" in result.stderr and bad.name in result.stderr
    assert not bad.exists()


def test_offline_without_an_earlier_fetch_is_refused(hub: Hub, tmp_path: Path) -> None:
    args = ["fetch", "--model", REPO, "--revision", "main", "--local-dir", str(tmp_path / "m"), "--offline"]
    result = run_cli(*args)
    assert result.exit_code == FetchError.exit_code
    assert "no earlier fetch" in result.stderr


def test_unknown_repo(hub: Hub, tmp_path: Path) -> None:
    result = run_cli(*fetch_args(hub, tmp_path / "m", repo="testorg/does-not-exist"))
    assert result.exit_code == FetchError.exit_code
    assert "testorg/does-not-exist not found" in result.stderr
    assert "HF_TOKEN" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("revision", ["no-such-branch", "0123456789abcdef0123456789abcdef01234567"])
def test_unknown_revision(hub: Hub, tmp_path: Path, revision: str) -> None:
    args = fetch_args(hub, tmp_path / "m")
    args[args.index("main")] = revision
    result = run_cli(*args)
    assert result.exit_code == FetchError.exit_code
    assert f"revision {revision!r} not found in {REPO}" in result.stderr
    assert "main" in result.stderr  # the hint lists the branches the repo has
    assert not (tmp_path / "m").exists()


def test_hub_unreachable(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{olah_server.free_port()}"
    result = run_cli(
        "fetch", "--model", REPO, "--revision", "main", "--local-dir", str(tmp_path / "m"), "--endpoint", dead
    )
    assert result.exit_code == FetchError.exit_code
    assert f"cannot reach {dead}" in result.stderr and "--offline" in result.stderr
    assert "Traceback" not in result.stderr


def test_short_disk_is_refused_before_downloading(hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.disk_usage

    def little_free(path: str | os.PathLike[str]) -> object:
        usage = real(path)
        return type(usage)(usage.total, usage.used, 10 * 2**20)

    monkeypatch.setattr(shutil, "disk_usage", little_free)
    dest = tmp_path / "model"
    result = run_cli(*fetch_args(hub, dest))
    assert result.exit_code == FetchError.exit_code
    assert "not enough disk space" in result.stderr and "10.0 MiB free" in result.stderr
    assert files_under(dest) == set()


def test_fetch_then_prepare_end_to_end(hub: Hub, tmp_path: Path) -> None:
    dest, out = tmp_path / "model", tmp_path / "prepared"
    assert run_cli(*fetch_args(hub, dest)).exit_code == 0
    result = run_cli("prepare", "--model", "gpt-oss-120b", "--src", str(dest), "--tp", "1", "--out", str(out), "--json")
    assert result.exit_code == 0, result.stderr
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    record = fetching.read_fetch_record(dest)
    assert record is not None
    # The manifest cites the fetch: the repo, the exact commit, and the hub-verified shard hashes.
    assert manifest["model"]["provenance"] == "prepkit fetch"
    assert manifest["model"]["source_repo"] == REPO
    assert record.commit in manifest_path.read_text(), "the manifest must cite the fetched commit"
    cited = manifest["model"]["source_files"]
    for entry in record.entries:
        if entry.path in cited:
            assert cited[entry.path]["sha256"] == entry.sha256 == hub.sha256(entry.path)
    assert {n for n in DEFAULT_FILES if n.endswith(".safetensors")} <= set(cited)


def test_ctrl_c_mid_download_then_rerun(hub: Hub, tmp_path: Path) -> None:
    """A real interruption: SIGINT while a big shard streams stops it at once, leaving no partial file;
    the rerun keeps every finished file and fetches only the rest."""
    import signal
    import subprocess
    import sys
    import time

    dest = tmp_path / "model"
    args = fetch_args(hub, dest, "--max-workers", "1", repo=BIG_REPO)
    # A process started with SIGINT ignored (e.g. by make in a background job) passes that on to its
    # children; the fetch gets the default handler back, as from a terminal.
    child = "\n".join(
        (
            "import signal",
            "signal.signal(signal.SIGINT, signal.default_int_handler)",
            "from prepkit.cli import main",
            "main()",
        )
    )
    cmd = [sys.executable, "-c", child, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial_dir = dest / ".cache" / "huggingface" / "download"
    deadline = time.monotonic() + 60
    # Partial files are named by a hash; the big shard is the only one that streams for long.
    while not list(partial_dir.glob("*.incomplete")) or not (dest / "generation_config.json").exists():
        assert proc.poll() is None, f"fetch ended before the big shard streamed: {proc.communicate()}"
        assert time.monotonic() < deadline, "the big shard never started streaming"
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("Ctrl-C did not stop the fetch") from None
    assert proc.returncode == 130, stderr
    assert not (dest / BIG_SHARD).exists()
    assert not (dest / FETCH_RECORD).exists()
    finished = {
        name for name in ("chat_template.jinja", "config.json", "generation_config.json") if (dest / name).exists()
    }
    assert finished  # workers=1 takes files in sorted order: these came before the big shard
    # The transfer was called off at its next chunk, so the library deleted its partial file.
    assert not list(dest.rglob("*.incomplete"))

    result = run_cli(*fetch_args(hub, dest, "--json", repo=BIG_REPO))
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert not finished & set(summary["downloaded"])
    assert BIG_SHARD in summary["downloaded"]
    assert not list(dest.rglob("*.incomplete"))
    assert (dest / BIG_SHARD).read_bytes() == (hub.src.parent / "big" / BIG_SHARD).read_bytes()


def test_new_commit_on_the_branch_fetches_only_the_changed_file(hub: Hub, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    assert run_cli(*fetch_args(hub, dest, repo=MOVING_REPO)).exit_code == 0
    config = json.loads((hub.src / "config.json").read_text()) | {"use_cache": False}
    new = olah_server.commit_file(hub.repos[MOVING_REPO], "config.json", json.dumps(config).encode())
    # What was verified at the old commit still counts where the hub's hash did not change.
    dry = json.loads(run_cli(*fetch_args(hub, dest, "--dry-run", "--json", repo=MOVING_REPO)).stdout)
    status = {f["path"]: f["status"] for f in dry["files"]}
    assert status.pop("config.json") != "verified" and set(status.values()) == {"verified"}

    result = run_cli(*fetch_args(hub, dest, "--json", repo=MOVING_REPO))
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["commit"] == new.commit
    assert summary["downloaded"] == ["config.json"]
    assert json.loads((dest / "config.json").read_text()) == config
    record = fetching.read_fetch_record(dest)
    assert record is not None and record.commit == new.commit


def test_new_commit_in_the_cache_links_the_unchanged_blobs(hub: Hub, tmp_path: Path) -> None:
    repo = hub.repos[MOVING_REPO]
    assert run_cli(*fetch_args(hub, None, repo=MOVING_REPO)).exit_code == 0
    config = json.loads((repo.path / "config.json").read_text()) | {"vocab_size": 257}
    new = olah_server.commit_file(repo, "config.json", json.dumps(config).encode())
    result = run_cli(*fetch_args(hub, None, "--json", repo=MOVING_REPO))
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["commit"] == new.commit and summary["dir"].endswith(new.commit)
    assert summary["downloaded"] == ["config.json"]
    assert sorted(summary["reused"]) == sorted(DEFAULT_FILES - {"config.json"})
    assert json.loads((Path(summary["dir"]) / "config.json").read_text()) == config

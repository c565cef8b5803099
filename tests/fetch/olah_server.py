"""Serve a local folder as a Hugging Face model repo through olah, for tests that need a real server.

olah only serves real git repos from its ``mirrors-path`` (``<mirrors>/models/<org>/<name>``), and
reads large files the way the hub stores them: a Git-LFS pointer in the tree and the bytes under
``.git/lfs/objects``. No git-lfs binary is needed for that, only git.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin")
_REPO_ROOT = Path(__file__).resolve().parents[2]


def find_olah_cli() -> str | None:
    """``$PREPKIT_OLAH_CLI``, then next to this interpreter (a venv run without activating it), then a
    separate ``.venv-olah`` in the repo (where olah's pins clash with the test env), then PATH."""
    candidates = [
        os.environ.get("PREPKIT_OLAH_CLI"),
        str(Path(sys.executable).parent / "olah-cli"),
        str(_REPO_ROOT / ".venv-olah" / "bin" / "olah-cli"),
    ]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("olah-cli")


@dataclass(frozen=True)
class MirrorRepo:
    repo_id: str
    commit: str
    path: Path  # the git work tree olah serves

    def lfs_object(self, sha256: str) -> Path:
        return self.path / ".git" / "lfs" / "objects" / sha256[:2] / sha256[2:4] / sha256


def _git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "prepkit tests",
        "GIT_AUTHOR_EMAIL": "tests@prepkit.invalid",
        "GIT_COMMITTER_NAME": "prepkit tests",
        "GIT_COMMITTER_EMAIL": "tests@prepkit.invalid",
        # Fixed dates give a reproducible commit sha for the same content.
        "GIT_AUTHOR_DATE": "2025-08-26T00:00:00Z",
        "GIT_COMMITTER_DATE": "2025-08-26T00:00:00Z",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    done = subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def lfs_pointer(data: bytes) -> bytes:
    sha = hashlib.sha256(data).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()


def build_mirror_repo(src: Path, mirrors: Path, repo_id: str, *, branch: str = "main") -> MirrorRepo:
    """Commit every file under ``src`` into ``<mirrors>/models/<repo_id>``; large-file suffixes go to LFS."""
    repo = mirrors / "models" / repo_id
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", branch)
    for file in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = file.relative_to(src)
        dest = repo / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        data = file.read_bytes()
        if file.suffix in LFS_SUFFIXES:
            sha = hashlib.sha256(data).hexdigest()
            obj = repo / ".git" / "lfs" / "objects" / sha[:2] / sha[2:4] / sha
            obj.parent.mkdir(parents=True, exist_ok=True)
            obj.write_bytes(data)
            dest.write_bytes(lfs_pointer(data))
        else:
            dest.write_bytes(data)
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "synthetic gpt-oss checkpoint")
    return MirrorRepo(repo_id=repo_id, commit=_git(repo, "rev-parse", "HEAD"), path=repo)


def commit_file(repo: MirrorRepo, path: str, data: bytes, message: str = "update") -> MirrorRepo:
    """Commit one more (non-LFS) file version on top of ``repo``; returns the repo at the new commit."""
    target = repo.path / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    _git(repo.path, "add", path)
    _git(repo.path, "commit", "-q", "-m", message)
    return MirrorRepo(repo_id=repo.repo_id, commit=_git(repo.path, "rev-parse", "HEAD"), path=repo.path)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_config(path: Path, *, port: int, mirrors: Path, repos: Path) -> None:
    # Upstream points at the discard port on loopback: offline mode should never use it, and if it
    # did, nothing leaves this machine.
    path.write_text(
        "[basic]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        f'repos-path = "{repos}"\n'
        'mirror-scheme = "http"\n'
        f'mirror-netloc = "127.0.0.1:{port}"\n'
        f'mirror-lfs-netloc = "127.0.0.1:{port}"\n'
        f'mirrors-path = ["{mirrors}"]\n'
        'hf-scheme = "http"\n'
        'hf-netloc = "127.0.0.1:9"\n'
        'hf-lfs-netloc = "127.0.0.1:9"\n'
        "\n[accessibility]\n"
        "offline = true\n"
    )


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def serve(
    mirrors: Path, workdir: Path, *, probe_repo: str, olah_cli: str, start_timeout: float = 60.0
) -> Iterator[str]:
    """Run olah offline on 127.0.0.1 and yield its endpoint; the process is stopped by PID afterwards."""
    port = free_port()
    config = workdir / "olah.toml"
    repos = workdir / "repos"
    logs = workdir / "logs"
    repos.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    _write_config(config, port=port, mirrors=mirrors, repos=repos)
    endpoint = f"http://127.0.0.1:{port}"
    log = (workdir / "olah.out").open("wb")
    proc = subprocess.Popen(
        [olah_cli, "-c", str(config), "--log-path", str(logs)],
        cwd=workdir,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: nothing of it outlives the test run
    )
    try:
        # The HTML index answers 500 in offline mode; a repo API route tells when it is really up.
        probe = f"{endpoint}/api/models/{probe_repo}/revision/main"
        deadline = time.monotonic() + start_timeout
        while not _ready(probe):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = (workdir / "olah.out").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"olah did not start (exit code {proc.poll()}):\n{tail}")
            time.sleep(0.05)
        yield endpoint
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


if __name__ == "__main__":  # manual use: python tests/fetch/olah_server.py SRC_DIR ORG/NAME
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="olah-"))
    mirror = build_mirror_repo(Path(sys.argv[1]), work / "mirrors", sys.argv[2])
    cli = find_olah_cli()
    if cli is None:
        sys.exit("olah-cli not found")
    with serve(work / "mirrors", work, probe_repo=mirror.repo_id, olah_cli=cli) as url:
        print(f"{url} serves {mirror.repo_id} @ {mirror.commit}; Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()

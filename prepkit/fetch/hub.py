"""The hub side of a fetch, through huggingface_hub's public API only: the commit and file list, and
``snapshot_download`` (its threads, locks, atomic renames and cache layout), with its progress and
its errors as FetchErrors."""

from __future__ import annotations

import contextlib
import errno
import glob
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prepkit import __version__
from prepkit.errors import FetchError
from prepkit.fetch.source import RemoteFile, Source

ProgressFn = Callable[[str, int, int], None]
TOTAL_LABEL = "all files"
AGAIN = "run the same command again; finished files are kept"


def list_remote(source: Source, *, endpoint: str, token: Any, cache: Path | None) -> tuple[str, list[RemoteFile]]:
    """The commit ``source.revision`` names and the repo's files there; in the cache a branch or tag
    gets its ref, for ``prepare --model`` and ``--offline``."""
    from huggingface_hub import HfApi, RepoFile

    api = HfApi(endpoint=endpoint, token=token, library_name="prepkit", library_version=__version__)
    with hub_errors(source, endpoint, api=api):
        # repo_info first, even for a commit (then of the default branch: servers differ on unknown
        # commits): without network it fails at once, where the paged tree listing retries for 26 s.
        is_commit = re.fullmatch(r"[0-9a-f]{40}", source.revision)
        commit = source.revision if is_commit else api.repo_info(source.repo_id, revision=source.revision).sha
        if is_commit:
            api.repo_info(source.repo_id)
        elif commit and cache is not None:
            api.resolve_revision(source.repo_id, revision=source.revision, cache_dir=cache)
        if not commit:
            raise FetchError(f"{endpoint} did not resolve {source.repo_id}@{source.revision} to a commit")
        tree = api.list_repo_tree(source.repo_id, revision=commit, recursive=True)
        files = sorted((e for e in tree if isinstance(e, RepoFile)), key=lambda e: e.path)
    rows = [(e.path, e.lfs.size, e.lfs.sha256, None) if e.lfs else (e.path, e.size, None, e.blob_id) for e in files]
    return commit, [RemoteFile(*row) for row in rows]


def snapshot(source: Source, commit: str, paths: list[str], *, endpoint: str, progress: Progress, **kw: Any) -> Any:
    """``snapshot_download`` of exactly ``paths`` at ``commit`` (``kw``: its other arguments), in a
    daemon thread so that Ctrl-C returns at once: the main thread calls it off through ``progress``,
    and each transfer stops at its next chunk and deletes its partial file."""
    from huggingface_hub import snapshot_download

    kw |= {"revision": commit, "endpoint": endpoint, "library_name": "prepkit", "library_version": __version__}
    kw["allow_patterns"] = [glob.escape(p) for p in paths]  # patterns matching these paths only
    kw["tqdm_class"] = type("ProgressBar", (_Bar,), {"owner": progress})
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(snapshot_download(source.repo_id, **kw))
        except BaseException as err:  # handed to the main thread
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True, name="prepkit-fetch")
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
    except BaseException:
        progress.cancel.set()
        thread.join(15)
        raise
    if outcome and isinstance(outcome[0], BaseException):
        with hub_errors(source, endpoint, filename=paths[0] if len(paths) == 1 else None):
            raise outcome[0]
    return outcome[0]


class Progress:
    """The bytes written, reported as one total; set :attr:`cancel` to call the download off."""

    def __init__(self, on_progress: ProgressFn | None, total: int) -> None:
        self.report = on_progress if on_progress and total else lambda label, done, total: None
        self.total, self.done, self.cancel, self.lock = total, 0, threading.Event(), threading.Lock()
        self.report(TOTAL_LABEL, 0, total)

    def advance(self, n: int) -> None:
        if self.cancel.is_set():  # raised in a download thread, which then deletes its partial file
            raise FetchError("the download was called off")
        with self.lock:  # the library's byte bars move together: the highest counts
            self.done = max(self.done, min(self.total, n))
            self.report(TOTAL_LABEL, self.done, self.total)


class _Bar:
    """The part of tqdm huggingface_hub drives; draws nothing, passes bytes on to its Progress."""

    owner: Progress
    format_dict: dict[str, Any] = {}

    def __init__(self, *args: Any, initial: int = 0, unit: str = "", **kw: Any) -> None:
        self.n, self.total, self.bytes = int(initial or 0), kw.get("total"), unit == "B"

    def update(self, n: float | None = 1) -> None:
        self.n += int(n or 0)
        if self.bytes:
            self.owner.advance(self.n)

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None  # refresh, close, set_postfix_str, set_description, ...

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@contextlib.contextmanager
def hub_errors(source: Source, endpoint: str, *, api: Any = None, filename: str | None = None) -> Iterator[None]:
    """huggingface_hub, httpx2 and OS errors as one FetchError with the next step. ``api`` is given
    while listing (the hint then names the repo's branches); ``filename`` names the file at fault."""
    import httpx2
    from huggingface_hub import errors as hf

    repo, what = source.repo_id, f"{filename} of {source.repo_id}" if filename else source.repo_id
    token_hint = "if the repo is private, set HF_TOKEN (or run `hf auth login`)"
    network_hint = "check the network and HF_ENDPOINT; if the model was fetched completely before, add --offline"

    def no_revision() -> FetchError:
        names = _branches(api, repo)
        hint = "give a branch, a tag or a full 40-character commit sha with --revision"
        hint += f"; {repo} has: {names}" if names else ""
        return FetchError(f"revision {source.revision!r} not found in {repo}", hint=hint)

    try:
        yield
    except FetchError:
        raise
    except hf.GatedRepoError as err:  # before RepositoryNotFoundError: it is a subclass of it
        hint = f"accept the terms at {endpoint}/{repo}, then set HF_TOKEN to a token of that account"
        raise FetchError(f"{repo} is gated and this account has not been granted access", hint=hint) from err
    except (hf.RevisionNotFoundError, hf.RepositoryNotFoundError, hf.RemoteEntryNotFoundError) as err:
        # olah answers an unknown branch with RepoNotFound and the tree of an unknown commit with EntryNotFound
        if isinstance(err, hf.RevisionNotFoundError) or _branches(api, repo):
            raise no_revision() from err
        if isinstance(err, hf.RemoteEntryNotFoundError):
            raise FetchError(f"{what} is missing at {source.revision}", hint="check --revision") from err
        raise FetchError(f"repository {repo} not found at {endpoint}", hint=f"check the repo id; {token_hint}") from err
    except hf.HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status in (401, 403):
            raise FetchError(f"{endpoint} refused access to {what} (HTTP {status})", hint=token_hint) from err
        late = "wait a few minutes, then " + AGAIN if status == 429 else AGAIN.replace("again", "again later")
        message = "is rate limiting requests for" if status == 429 else "failed on"
        raise FetchError(f"{endpoint} {message} {what} (HTTP {status})", hint=late) from err
    except (httpx2.ConnectError, httpx2.TimeoutException, hf.OfflineModeIsEnabled, hf.LocalEntryNotFoundError) as err:
        raise FetchError(f"cannot reach {endpoint} for {what}: {err}", hint=network_hint) from err
    except httpx2.HTTPError as err:
        raise FetchError(f"the transfer of {what} broke off: {err}", hint=AGAIN) from err
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            hint = f"free some space, then {AGAIN}; partial ones are removed"
            raise FetchError(f"disk full while writing {what}: {err.strerror}", hint=hint) from err
        if "Consistency check failed" in str(err):
            raise FetchError(f"{what} arrived with the wrong size (the connection dropped?)", hint=AGAIN) from err
        raise FetchError(f"cannot write {what}: {err}") from err


def _branches(api: Any, repo: str) -> str:
    """The repo's branches and tags ("" when there is no ``api`` or they cannot be listed)."""
    try:
        refs = api.list_repo_refs(repo)
        return ", ".join(sorted({b.name for b in refs.branches} | {t.name for t in refs.tags})[:10])
    except Exception:
        return ""

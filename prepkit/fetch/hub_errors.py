"""huggingface_hub, httpx2 and OS errors, turned into one FetchError with the next step to take."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import Any

from prepkit.errors import FetchError
from prepkit.fetch.hashing import HashMismatch
from prepkit.fetch.source import Source


@contextlib.contextmanager
def hub_errors(
    source: Source, endpoint: str, *, stage: str, api: Any = None, filename: str | None = None
) -> Iterator[None]:
    """Turn huggingface_hub / httpx2 / OS errors into one FetchError with the next step to take."""
    import httpx2
    from huggingface_hub import errors as hf

    repo = source.repo_id
    what = f"{filename} of {repo}" if filename else repo
    token_hint = "if the repo is private, set HF_TOKEN (or run `hf auth login`)"
    try:
        yield
    except (FetchError, HashMismatch):
        raise
    except hf.GatedRepoError as err:  # before RepositoryNotFoundError: it is a subclass of it
        raise FetchError(
            f"{repo} is gated and this account has not been granted access",
            hint=f"accept the terms at {endpoint}/{repo}, then set HF_TOKEN to a token of that account",
        ) from err
    except hf.RevisionNotFoundError as err:
        raise FetchError(f"revision {source.revision!r} not found in {repo}", hint=_revision_hint(source, api)) from err
    except hf.RepositoryNotFoundError as err:
        if stage == "listing" and _repo_exists(api, repo):
            # Some servers (olah) answer an unknown branch with RepoNotFound.
            raise FetchError(
                f"revision {source.revision!r} not found in {repo}", hint=_revision_hint(source, api)
            ) from err
        raise FetchError(f"repository {repo} not found at {endpoint}", hint=f"check --model; {token_hint}") from err
    except hf.LocalEntryNotFoundError as err:  # before RemoteEntryNotFoundError's base: it shares it
        raise FetchError(f"cannot reach {endpoint} for {what}", hint=_network_hint()) from err
    except hf.RemoteEntryNotFoundError as err:
        if stage == "listing":
            # The tree of an unknown commit: the hub says RevisionNotFound, olah says EntryNotFound.
            raise FetchError(
                f"revision {source.revision!r} not found in {repo}", hint=_revision_hint(source, api)
            ) from err
        raise FetchError(f"{what} is missing at {source.revision}", hint="check --revision") from err
    except hf.HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status in (401, 403):
            raise FetchError(f"{endpoint} refused access to {what} (HTTP {status})", hint=token_hint) from err
        if status == 429:
            raise FetchError(
                f"{endpoint} is rate limiting requests for {what} (HTTP 429)",
                hint="wait a few minutes and run the same command again; finished files are kept",
            ) from err
        raise FetchError(
            f"{endpoint} failed on {what} (HTTP {status})",
            hint="run the same command again later; finished files are kept",
        ) from err
    except (httpx2.ConnectError, httpx2.TimeoutException, hf.OfflineModeIsEnabled) as err:
        raise FetchError(f"cannot reach {endpoint} for {what}: {err}", hint=_network_hint()) from err
    except httpx2.HTTPError as err:
        raise FetchError(
            f"the transfer of {what} broke off: {err}",
            hint="run the same command again; finished files are kept",
        ) from err
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise FetchError(
                f"disk full while writing {what}: {err.strerror}",
                hint="free some space and run the same command again; finished files are kept, "
                "partial ones are removed",
            ) from err
        if "Consistency check failed" in str(err):
            raise FetchError(
                f"{what} arrived with the wrong size (the connection dropped?)",
                hint="run the same command again; finished files are kept",
            ) from err
        raise FetchError(f"cannot write {what}: {err}") from err
    except ValueError as err:
        if "too large" in str(err):  # > 50 GB over plain HTTP (huggingface_hub's MAX_HTTP_DOWNLOAD_SIZE)
            raise FetchError(
                f"{what} is too large for a plain HTTP download", hint="install hf_xet, and unset HF_HUB_DISABLE_XET"
            ) from err
        raise


def _network_hint() -> str:
    return (
        "check the network and HF_ENDPOINT; if the model was fetched completely before, "
        "add --offline to check it without the hub"
    )


def _repo_exists(api: Any, repo: str) -> bool:
    if api is None:
        return False
    try:
        api.list_repo_refs(repo)
    except Exception:
        return False
    return True


def _revision_hint(source: Source, api: Any) -> str:
    hint = "give a branch, a tag or a full 40-character commit sha with --revision"
    if api is not None:
        with contextlib.suppress(Exception):
            refs = api.list_repo_refs(source.repo_id)
            names = sorted({b.name for b in refs.branches} | {t.name for t in refs.tags})
            if names:
                hint += f"; {source.repo_id} has: {', '.join(names[:10])}"
    return hint

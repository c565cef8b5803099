"""huggingface_hub, httpx2 and OS errors, turned into one FetchError with the next step to take."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import Any

from prepkit.errors import FetchError
from prepkit.fetch.source import Source

TOKEN_HINT = "if the repo is private, set HF_TOKEN (or run `hf auth login`)"
AGAIN = "run the same command again; finished files are kept"
NETWORK_HINT = (
    "check the network and HF_ENDPOINT; if the model was fetched completely before, add --offline to check it "
    "without the hub"
)


@contextlib.contextmanager
def hub_errors(source: Source, endpoint: str, *, api: Any = None, filename: str | None = None) -> Iterator[None]:
    """``api`` is given while listing (it lists the repo's branches for the hint); ``filename`` names
    the file at fault, when one is."""
    import httpx2
    from huggingface_hub import errors as hf

    repo = source.repo_id
    what = f"{filename} of {repo}" if filename else repo

    def no_revision() -> FetchError:
        return FetchError(f"revision {source.revision!r} not found in {repo}", hint=_revision_hint(source, api))

    try:
        yield
    except FetchError:
        raise
    except hf.GatedRepoError as err:  # before RepositoryNotFoundError: it is a subclass of it
        raise FetchError(
            f"{repo} is gated and this account has not been granted access",
            hint=f"accept the terms at {endpoint}/{repo}, then set HF_TOKEN to a token of that account",
        ) from err
    except hf.RevisionNotFoundError as err:
        raise no_revision() from err
    except hf.RepositoryNotFoundError as err:
        if api is not None and _refs(api, repo) is not None:
            raise no_revision() from err  # some servers (olah) answer an unknown branch with RepoNotFound
        raise FetchError(f"repository {repo} not found at {endpoint}", hint=f"check the repo id; {TOKEN_HINT}") from err
    except hf.LocalEntryNotFoundError as err:  # before RemoteEntryNotFoundError's base: it shares it
        raise FetchError(f"cannot reach {endpoint} for {what}", hint=NETWORK_HINT) from err
    except hf.RemoteEntryNotFoundError as err:
        if api is not None:
            raise no_revision() from err  # the tree of an unknown commit: olah says EntryNotFound
        raise FetchError(f"{what} is missing at {source.revision}", hint="check --revision") from err
    except hf.HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status in (401, 403):
            raise FetchError(f"{endpoint} refused access to {what} (HTTP {status})", hint=TOKEN_HINT) from err
        if status == 429:
            message = f"{endpoint} is rate limiting requests for {what} (HTTP 429)"
            raise FetchError(message, hint=f"wait a few minutes, then {AGAIN}") from err
        raise FetchError(
            f"{endpoint} failed on {what} (HTTP {status})", hint=AGAIN.replace("again", "again later")
        ) from err
    except (httpx2.ConnectError, httpx2.TimeoutException, hf.OfflineModeIsEnabled) as err:
        raise FetchError(f"cannot reach {endpoint} for {what}: {err}", hint=NETWORK_HINT) from err
    except httpx2.HTTPError as err:
        raise FetchError(f"the transfer of {what} broke off: {err}", hint=AGAIN) from err
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            message = f"disk full while writing {what}: {err.strerror}"
            raise FetchError(message, hint=f"free some space, then {AGAIN}; partial ones are removed") from err
        if "Consistency check failed" in str(err):
            raise FetchError(f"{what} arrived with the wrong size (the connection dropped?)", hint=AGAIN) from err
        raise FetchError(f"cannot write {what}: {err}") from err
    except ValueError as err:
        if "too large" in str(err):  # > 50 GB over plain HTTP (huggingface_hub's MAX_HTTP_DOWNLOAD_SIZE)
            hint = "install hf_xet, and unset HF_HUB_DISABLE_XET"
            raise FetchError(f"{what} is too large for a plain HTTP download", hint=hint) from err
        raise


def _refs(api: Any, repo: str) -> list[str] | None:
    """The repo's branches and tags, or None when it cannot be listed."""
    try:
        refs = api.list_repo_refs(repo)
    except Exception:
        return None
    return sorted({b.name for b in refs.branches} | {t.name for t in refs.tags})


def _revision_hint(source: Source, api: Any) -> str:
    hint = "give a branch, a tag or a full 40-character commit sha with --revision"
    names = _refs(api, source.repo_id) if api is not None else None
    return hint + (f"; {source.repo_id} has: {', '.join(names[:10])}" if names else "")

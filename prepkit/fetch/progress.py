"""Progress of a fetch: per-file and total byte counts, fed by huggingface_hub's progress-bar hooks
from many threads through a tqdm look-alike that draws nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prepkit.fetch.source import RemoteFile

if TYPE_CHECKING:
    from prepkit.fetch.plan import FetchPlan

ProgressFn = Callable[[str, int, int], None]

TOTAL_LABEL = "all files"


class Progress:
    """Per-file and total byte counts, fed by huggingface_hub's progress-bar hooks from many threads."""

    def __init__(self, on_progress: ProgressFn | None, plan: FetchPlan) -> None:
        self._report = on_progress
        self._lock = threading.Lock()
        self._per_file: dict[str, int] = {}
        self._total = sum(f.remote.size for f in plan.files if f.status != "verified")
        self._done = 0
        if self._report is not None and self._total:
            self._report(TOTAL_LABEL, 0, self._total)

    def set(self, remote: RemoteFile, done: int) -> None:
        if self._report is None:
            return
        with self._lock:
            done = max(0, min(done, remote.size))
            self._done += done - self._per_file.get(remote.path, 0)
            self._per_file[remote.path] = done
            self._report(remote.path, done, remote.size)
            self._report(TOTAL_LABEL, self._done, self._total)

    def done(self, remote: RemoteFile) -> None:
        self.set(remote, remote.size)

    def bar_for(self, remote: RemoteFile) -> Callable[..., ProgressBar]:
        def make(**kwargs: Any) -> ProgressBar:
            return ProgressBar(self, remote, initial=int(kwargs.get("initial") or 0))

        return make


class ProgressBar:
    """The subset of the tqdm interface huggingface_hub drives (HTTP and Xet paths); draws nothing."""

    def __init__(self, progress: Progress, remote: RemoteFile, *, initial: int = 0) -> None:
        self._progress = progress
        self._remote = remote
        self.n = initial
        self.total: int | None = remote.size
        progress.set(remote, self.n)

    def update(self, n: int | float | None = 1) -> None:
        self.n += int(n or 0)
        self._progress.set(self._remote, self.n)

    def update_transfer(self, n: int | float | None = 1) -> None:
        pass  # network bytes; disk bytes (update) are what the bars show

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_transfer_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

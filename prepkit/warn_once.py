"""``warn_once``: the one place that remembers which warnings were already given.

A key is warned about once per owner. The owner is the object whose warnings are its own (a
runtime layer, a tactic resolver): :func:`owned_by` makes it current around a call, so a helper
that runs inside (the tactic lookup a layer calls) warns once for that layer, and another layer
hears it again. Outside any owner a key is warned once per process.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
from collections.abc import Hashable, Iterator
from contextvars import ContextVar

_SEEN: set[tuple[Hashable, Hashable]] = set()
_LOCK = threading.Lock()
_OWNER: ContextVar[Hashable] = ContextVar("prepkit_warning_owner", default=None)
_TOKENS = itertools.count(1)


def new_owner() -> int:
    """A token no other owner has (ids of objects may be reused after they are freed)."""
    return next(_TOKENS)


@contextlib.contextmanager
def owned_by(owner: Hashable) -> Iterator[None]:
    """Warnings given inside the block belong to ``owner``."""
    token = _OWNER.set(owner)
    try:
        yield
    finally:
        _OWNER.reset(token)


def warn_once(key: Hashable, message: str, category: type[Warning] = UserWarning, *, stacklevel: int = 2) -> bool:
    """Warn ``message`` unless ``key`` was already warned about for the current owner; whether it
    warned. ``stacklevel`` counts from the caller, as ``warnings.warn`` does."""
    slot = (_OWNER.get(), key)
    with _LOCK:
        if slot in _SEEN:
            return False
        _SEEN.add(slot)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    return True

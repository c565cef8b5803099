"""Ids for torch ops to find the Python object they run: a registered op takes an int, not the
module (a module is no op argument), and the object stays held weakly, its id dropped with it."""

from __future__ import annotations

import itertools
import weakref
from typing import Generic, TypeVar

T = TypeVar("T")


class WeakRegistry(Generic[T]):
    """Objects of one kind under fresh int ids, held weakly; ``what`` names the op and ``kind``
    the objects in errors."""

    def __init__(self, what: str, kind: str) -> None:
        self.what, self.kind = what, kind
        self._refs: dict[int, weakref.ref[T]] = {}
        self._next_id = itertools.count()

    def add(self, obj: T) -> int:
        """A new id under which :meth:`get` finds ``obj``."""
        obj_id = next(self._next_id)

        def forget(_ref: weakref.ref[T]) -> None:
            self._refs.pop(obj_id, None)

        self._refs[obj_id] = weakref.ref(obj, forget)
        return obj_id

    def get(self, obj_id: int) -> T:
        """The object behind ``obj_id``.

        Raises:
            KeyError: no live object has that id (never registered, or freed).
        """
        ref = self._refs.get(obj_id)
        obj = ref() if ref is not None else None
        if obj is None:
            raise KeyError(f"{self.what}: no live {self.kind} has id {obj_id}")
        return obj

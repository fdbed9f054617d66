"""A facade's read-only attribute that shows one of its parts' (``Forward``).

A thin facade (``Scheduler``, the controller's ``CentralScheduler``) shows
counters and settings its single-purpose parts keep. Each used to be a
property of three lines that returned ``self.part.name``; one line now says
where it comes from::

    dispatched: Forward[int] = Forward("passes.dispatched", "How many dispatches it made.")
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class Forward(Generic[T]):
    """A read-only attribute read from ``path`` (dotted) on the instance, with its doc."""

    def __init__(self, path: str, doc: str = "") -> None:
        self._get = attrgetter(path)
        self.path = path
        self.__doc__ = doc

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> Forward[T]: ...

    @overload
    def __get__(self, instance: object, owner: type[Any]) -> T: ...

    def __get__(self, instance: object | None, owner: type[Any]) -> Forward[T] | T:
        if instance is None:
            return self
        value: T = self._get(instance)
        return value

    def __set__(self, instance: object, value: object) -> None:
        raise AttributeError(f"read-only: it shows {self.path}")

"""celery-singleton's exceptions, under singletask's root :class:`~singletask.SingletaskError`."""

from __future__ import annotations

from typing import Any

from ...exceptions import SingletaskError

__all__ = ["CelerySingletonException", "DuplicateTaskError"]


class CelerySingletonException(SingletaskError):
    """Root of celery-singleton's exceptions."""


class DuplicateTaskError(CelerySingletonException):
    """A duplicate was sent while ``task_id`` holds the lock (``raise_on_duplicate``)."""

    def __init__(self, message: str, task_id: str) -> None:
        super().__init__(message, task_id)  # both in args: it survives pickling
        self.task_id = task_id

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.task_id))

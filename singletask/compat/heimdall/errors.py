"""celery-heimdall's exception, under singletask's root :class:`~singletask.SingletaskError`."""

from __future__ import annotations

from typing import Any

from ...exceptions import SingletaskError

__all__ = ["AlreadyQueuedError"]


class AlreadyQueuedError(SingletaskError):
    """The task is queued already; ``likely_culprit``: the holder's task id (when known),
    ``expires_in``: seconds before its lock expires."""

    def __init__(self, *, expires_in: int | None = None, likely_culprit: str | None = None):
        super().__init__()
        self.likely_culprit = likely_culprit
        self.expires_in = expires_in

    def __repr__(self) -> str:
        return (
            f"<AlreadyQueuedError(likely_culprit={self.likely_culprit!r},"
            f" expires_in={self.expires_in!r})>"
        )

    def __reduce__(self) -> Any:
        return (rebuild, (self.expires_in, self.likely_culprit))


def rebuild(expires_in: int | None, likely_culprit: str | None) -> AlreadyQueuedError:
    """Unpickle an :class:`AlreadyQueuedError` (its fields are keyword-only)."""
    return AlreadyQueuedError(expires_in=expires_in, likely_culprit=likely_culprit)

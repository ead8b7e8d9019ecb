"""celery-heimdall's settings: the task's ``heimdall`` dict, else ``heimdall_<name>`` of the
app, else the default."""

from __future__ import annotations

from typing import Any

from celery.app import app_or_default

__all__ = ["Config"]


class Config:
    def __init__(self, app: Any, *, task: Any = None) -> None:
        self.app = app_or_default(app)
        self.task = task

    def _from_task_or_app(self, key: str, default: Any) -> Any:
        if self.task is not None:
            value = (getattr(self.task, "heimdall", None) or {}).get(key)
            if value is not None:
                return value
        return self.app.conf.get(f"heimdall_{key}", default)

    @property
    def unique_lock_timeout(self) -> Any:
        return self._from_task_or_app("unique_lock_timeout", 1)

    @property
    def unique_lock_blocking(self) -> Any:
        return self._from_task_or_app("unique_lock_blocking", True)

    @property
    def unique_timeout(self) -> Any:
        return self._from_task_or_app("unique_timeout", 60 * 60)

    @property
    def lock_prefix(self) -> Any:
        return self._from_task_or_app("lock_prefix", "h-lock:")

    @property
    def rate_limit_prefix(self) -> Any:
        return self._from_task_or_app("rate_limit_prefix", "h-rate:")

    @property
    def unique_raises(self) -> Any:
        return self._from_task_or_app("unique_raises", False)

    @property
    def owner_checked_release(self) -> bool:
        """singletask's option (False: release by key, as celery-heimdall does)."""
        return bool(self._from_task_or_app("owner_checked_release", False))

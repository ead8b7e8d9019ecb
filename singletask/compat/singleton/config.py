"""celery-singleton's settings, read from the app at each use: ``singleton_backend_url``,
``singleton_backend_class``, ``singleton_backend_kwargs``, ``singleton_key_prefix``,
``singleton_raise_on_duplicate``, ``singleton_lock_expiry``; and singletask's
``singleton_owner_checked_release`` (False: release by key, as celery-singleton does)."""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["Config"]


class Config:
    def __init__(self, app: Any) -> None:
        self.app = app

    def _get(self, name: str, default: Any = None) -> Any:
        return self.app.conf.get(name, default)

    @property
    def key_prefix(self) -> str:
        return str(self._get("singleton_key_prefix", "SINGLETONLOCK_"))

    @property
    def backend_class(self) -> Any:
        given = self._get(
            "singleton_backend_class", "singletask.compat.singleton.backends.redis.RedisBackend"
        )
        if isinstance(given, str):
            module_name, _, class_name = given.rpartition(".")
            return getattr(import_module(module_name), class_name)
        return given

    @property
    def backend_kwargs(self) -> dict[str, Any]:
        return dict(self._get("singleton_backend_kwargs", {}) or {})

    @property
    def backend_url(self) -> Any:
        url = self._get("singleton_backend_url")
        if url is not None:
            return url
        url = self._get("result_backend")
        if not url or not str(url).startswith("redis://"):
            url = self._get("broker_url")
        return url

    @property
    def raise_on_duplicate(self) -> Any:
        return self._get("singleton_raise_on_duplicate")

    @property
    def lock_expiry(self) -> Any:
        return self._get("singleton_lock_expiry")

    @property
    def owner_checked_release(self) -> bool:
        return bool(self._get("singleton_owner_checked_release", False))

"""celery-once's stock backends: ``Redis`` and ``File`` (by dotted path in ``ONCE``)."""

from __future__ import annotations

from .file import File
from .redis import Redis

__all__ = ["File", "Redis"]

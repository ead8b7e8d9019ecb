"""celery-singleton's key: prefix + md5(name + json(args) + json(kwargs)), keys sorted."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from hashlib import md5
from typing import Any

__all__ = ["generate_lock"]


def generate_lock(
    task_name: str,
    task_args: Sequence[Any] | None = None,
    task_kwargs: Mapping[str, Any] | None = None,
    key_prefix: str = "SINGLETONLOCK_",
) -> str:
    text = task_name + json.dumps(task_args or [], sort_keys=True)
    text += json.dumps(task_kwargs or {}, sort_keys=True)
    return key_prefix + md5(text.encode()).hexdigest()

"""``HeimdallTask``, as celery-heimdall 1.0.1 defines it, with singletask's execution-time
guarantees (:mod:`singletask.compat.guard`) and a sliding-log rate limit.

The rate limit ``times`` per ``per`` seconds is a log of start times per key (a Redis sorted
set, read and written in one optimistic transaction): a start is admitted while fewer than
``times`` starts lie within the last ``per`` seconds; otherwise the execution is given the
first start the log allows after those already given (2 per 10 s: starts at 0 s, 0 s, 10 s,
10 s, 20 s...), kept under its task id, and sent again for then. The deferral spends none of
the task's retries and leaves its ``max_retries`` alone.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import redis
from celery import Task
from kombu import serialization
from kombu.utils.uuid import uuid as task_uuid

from ...exceptions import ConfigurationError
from ..guard import guarded_call, option_dict, with_key
from .config import Config
from .errors import AlreadyQueuedError

if TYPE_CHECKING:
    from celery.result import AsyncResult

__all__ = [
    "HEIMDALL_OPTIONS",
    "HeimdallTask",
    "RateLimit",
    "Strategy",
    "acquire_lock",
    "rate_limited_countdown",
    "release_lock",
    "renew_lock",
    "unique_key_for_task",
]

#: The keys of a task's ``heimdall`` option.
HEIMDALL_OPTIONS = frozenset({
    "unique", "unique_timeout", "unique_wait_for_expiry", "unique_raises", "unique_lock_timeout",
    "unique_lock_blocking", "key", "lock_prefix", "rate_limit_prefix", "rate_limit", "times",
    "per", "owner_checked_release",
})  # fmt: skip

#: Delete a key only while it holds the given task id.
UNLOCK_IF_OWNER = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class Strategy(enum.Enum):
    DEFAULT = 10


@dataclasses.dataclass
class RateLimit:
    """``RateLimit((times, per))``, or a callable taking any of ``key``, ``task``, ``args``,
    ``kwargs`` and giving ``(times, per)``."""

    rate_limit: tuple[int, float] | Callable[..., tuple[int, float]]
    strategy: Strategy = Strategy.DEFAULT


def acquire_lock(task: Any, key: str, timeout: float, *, task_id: str) -> bool:
    """Set ``key`` to ``task_id`` for ``timeout`` seconds (waiting up to
    ``unique_lock_timeout`` if ``unique_lock_blocking``), or raise :class:`AlreadyQueuedError`."""
    client = task.heimdall_redis
    config = task.heimdall_config
    deadline = time.monotonic() + float(config.unique_lock_timeout or 0)
    while not client.set(key, task_id, nx=True, px=max(1, int(float(timeout) * 1000))):
        if not config.unique_lock_blocking or time.monotonic() >= deadline:
            holder, ttl = client.pipeline().get(key).ttl(key).execute()
            raise AlreadyQueuedError(
                expires_in=max(0, ttl or 0),
                likely_culprit=holder.decode() if isinstance(holder, bytes) else holder,
            )
        time.sleep(0.05)
    return True


def release_lock(task: Any, key: str, task_id: str | None = None) -> None:
    """Delete ``key`` (with ``task_id``: only while that task holds it)."""
    if task_id is None:
        task.heimdall_redis.delete(key)
    else:
        task.heimdall_redis.eval(UNLOCK_IF_OWNER, 1, key, task_id)


def renew_lock(task: Any, key: str, timeout: float, *, task_id: str) -> None:
    """Give ``key`` ``timeout`` seconds again while ``task_id`` holds it (singletask's
    addition: the lock of a running task is a lease)."""

    def renew(pipe: Any) -> None:
        holder = pipe.get(key)
        pipe.multi()
        if holder in (task_id, task_id.encode()):
            pipe.pexpire(key, max(1, int(float(timeout) * 1000)))

    task.heimdall_redis.transaction(renew, key)


def unique_key_for_task(task: Any, args: Any, kwargs: Any, *, prefix: str = "") -> str:
    """``prefix`` + the task's ``key`` (a string, or a callable of ``(args, kwargs)``), else
    + md5 of the task name and the JSON of ``(args, kwargs)``."""
    options = getattr(task, "heimdall", None) or {}
    args = args or []
    kwargs = kwargs or {}
    if "key" in options:
        given = options["key"]
        return prefix + str(given(args, kwargs) if callable(given) else given)
    _, _, data = serialization.dumps((args, kwargs), "json")
    digest = hashlib.md5(task.name.encode("utf-8"))
    digest.update(data.encode("utf-8") if isinstance(data, str) else data)
    return f"{prefix}{digest.hexdigest()}"


def rate_of(task: Any, key: str, args: Any, kwargs: Any) -> tuple[int, float]:
    """The ``(times, per)`` of a call."""
    options = getattr(task, "heimdall", None) or {}
    if "rate_limit" not in options:
        return int(options["times"]), float(options["per"])
    given = options["rate_limit"].rate_limit
    if not callable(given):
        return int(given[0]), float(given[1])
    offered = {"key": key, "task": task, "args": args, "kwargs": kwargs}
    wanted = inspect.signature(given).parameters
    times, per = given(**{name: value for name, value in offered.items() if name in wanted})
    return int(times), float(per)


def rate_limited_countdown(task: Any, key: str, args: Any, kwargs: Any) -> float:
    """Give this execution a start under ``key``'s rate: 0 to start now, else the seconds
    until its start, which is kept for it (by task id) so that deferred executions start in
    the order they asked, one ``per`` after the start ``times`` places ahead of them."""
    times, per = rate_of(task, key, args, kwargs)
    member = str(getattr(task.request, "id", None) or uuid.uuid4().hex)

    def reserve(pipe: Any) -> float:
        now = time.time()
        start = pipe.zscore(key, member)
        if start is None:
            kept = sorted(score for _, score in pipe.zrangebyscore(
                key, f"({now - per}", "+inf", withscores=True))  # fmt: skip
            start = now if len(kept) < times else max(now, kept[-times] + per)
        pipe.multi()
        pipe.zremrangebyscore(key, "-inf", now - per)
        pipe.zadd(key, {member: start})
        pipe.expire(key, int(start - now + per) + 1)
        return float(start - now)

    wait = float(task.heimdall_redis.transaction(reserve, key, value_from_callable=True))
    return 0.0 if wait < 0.01 else wait


if TYPE_CHECKING:
    _TaskBase = Task[Any, Any]
else:
    _TaskBase = Task


class HeimdallTask(_TaskBase):
    """A task with ``heimdall={...}``: ``unique`` (present: one queued or running per key),
    ``unique_raises``, ``unique_timeout``, ``unique_wait_for_expiry``, ``key``, and a rate
    limit (``rate_limit=RateLimit((times, per))`` or ``times``/``per``)."""

    abstract = True
    heimdall: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_heimdall(cls)

    def __init__(self) -> None:
        super().__init__()
        self._heimdall_config: Config | None = None
        self._heimdall_redis: Any = None

    @property
    def heimdall_config(self) -> Config:
        if self._heimdall_config is None:
            self._heimdall_config = Config(self.app, task=self)
        return self._heimdall_config

    @property
    def heimdall_redis(self) -> Any:
        if self._heimdall_redis is None:
            self._heimdall_redis = self.setup_redis()
        return self._heimdall_redis

    def setup_redis(self) -> Any:
        """The Redis client: the result backend's if ``redis://``, else the broker's;
        override it to give your own."""
        for setting in ("result_backend", "broker_url"):
            url = str(self.app.conf.get(setting) or "")
            if url.startswith("redis://"):
                return redis.Redis.from_url(url)
        raise NotImplementedError(
            f"task {self.name}: no redis:// result backend or broker; override setup_redis()"
        )

    def unique_key(self, args: Any, kwargs: Any) -> str:
        return unique_key_for_task(self, args, kwargs, prefix=self.heimdall_config.lock_prefix)

    def apply_async(  # type: ignore[override]
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        **options: Any,
    ) -> AsyncResult[Any]:
        """With ``unique``, lock the key first: a duplicate gets the holder's
        ``AsyncResult``, or with ``unique_raises`` :class:`AlreadyQueuedError`."""
        if "unique" in self.heimdall:
            key = self.unique_key(args, kwargs)
            if task_id is not None and self.holds(key, task_id):  # its own retry, a deferral
                options = with_key(options, key)
                return super().apply_async(args, kwargs, task_id=task_id, **options)  # type: ignore[arg-type]
            task_id = task_id or task_uuid()
            timeout = self.heimdall.get("unique_timeout", self.heimdall_config.unique_timeout)
            try:
                acquire_lock(self, key, timeout, task_id=task_id)
            except AlreadyQueuedError as exc:
                if not self.heimdall_config.unique_raises and exc.likely_culprit is not None:
                    return self.AsyncResult(exc.likely_culprit)
                raise
            options = with_key(options, key)
        return super().apply_async(args, kwargs, task_id=task_id, **options)  # type: ignore[arg-type]

    def holds(self, key: str, task_id: str) -> bool:
        """Whether ``task_id`` holds ``key`` (a retry or deferral of the holder is sent on)."""
        return self.heimdall_redis.get(key) in (task_id, task_id.encode())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.defer_for_rate(args, kwargs):
            return None
        if "unique" not in self.heimdall:
            return super().__call__(*args, **kwargs)
        task_id = self.request.id
        timeout = self.heimdall.get("unique_timeout", self.heimdall_config.unique_timeout)

        def take(key: str) -> AlreadyQueuedError | None:
            try:
                acquire_lock(self, key, timeout, task_id=str(task_id))
            except AlreadyQueuedError as exc:
                return None if exc.likely_culprit == task_id else exc
            return None

        owner = task_id if self.heimdall_config.owner_checked_release else None
        return guarded_call(
            self, super().__call__, args, kwargs,
            key_for=self.unique_key, take=take,
            release=lambda key: release_lock(self, key, owner),
            on_duplicate=lambda refused: None,  # as heimdall: SUCCESS, None; the holder keeps it
            release_at_end=not self.heimdall.get("unique_wait_for_expiry"),
            renew=None if self.heimdall.get("unique_wait_for_expiry") else (
                lambda key: renew_lock(self, key, timeout, task_id=str(task_id))
            ),
            lease=float(timeout),
        )  # fmt: skip

    def defer_for_rate(self, args: Any, kwargs: Any) -> bool:
        """Take a start of the rate limit, or send the task again for when one is free
        (raises Retry in a worker; in eager mode waits here, then runs). False: go on."""
        options = self.heimdall
        request = self.request
        if request.called_directly or not (
            "rate_limit" in options or ("times" in options and "per" in options)
        ):
            return False
        key = unique_key_for_task(self, args, kwargs, prefix=self.heimdall_config.rate_limit_prefix)
        while (wait := rate_limited_countdown(self, key, args, kwargs)) > 0:
            if not request.is_eager:
                request.retries = max(0, (request.retries or 0) - 1)  # spends no retry
                raise self.retry(countdown=wait)
            time.sleep(wait)
        return False

    def only_after(self, key: str, seconds: int) -> bool:
        """True at most once per ``seconds`` for ``key`` (for a block inside a task)."""
        task_id = getattr(self.request, "id", None) or task_uuid()
        return bool(self.heimdall_redis.set(key, task_id, nx=True, ex=int(seconds)))


def check_heimdall(cls: type[HeimdallTask]) -> None:
    """Refuse, when the task class is made, a ``heimdall`` option celery-heimdall lacks."""
    found = option_dict(cls, "heimdall", HEIMDALL_OPTIONS)
    if found is None:
        return
    name, options = found
    if ("times" in options) != ("per" in options):
        raise ConfigurationError(f"task {name}: heimdall needs both 'times' and 'per'")
    limit = options.get("rate_limit")
    if limit is not None and not isinstance(limit, RateLimit):
        raise ConfigurationError(f"task {name}: heimdall['rate_limit'] must be a RateLimit")

"""What the three compatibility bases share: singletask's execution-time guarantees.

The old libraries lock when a task is *sent* and release from a hook that does not run on
every ending. Under the compatibility layer the send-time lock stays (with the old key and the
old store), and an execution also:

* runs under the key its send locked, carried in a message header, so a key is never rebuilt
  on the worker from arguments that arrive changed (a tuple sent, a list received);
* takes the lock itself when no send took it (``send_task()``, beat's fallback, a message
  published by other code), and treats a held lock as a duplicate (``task.apply()``, which
  runs the body in the caller's process, does not: it runs and frees the key, as before);
* renews the lock while the body runs, where the store can (the stock stores, a lock with a
  lifetime): the lifetime becomes a lease, so a long run keeps its lock and a dead worker's
  lock ends one lifetime after its last renewal;
* releases in ``__call__``'s ``finally``: on success, failure, ``Ignore``, ``Reject``, a
  replaced task; a ``self.retry()`` keeps the lock for the retried message.

A direct call (``task(x)``) takes no lock, as in the old libraries.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from celery.exceptions import Retry

from ..exceptions import ConfigurationError
from ..protocol.headers import header_value, with_header

__all__ = [
    "KEY_HEADER",
    "LEASE_HEADER",
    "guarded_call",
    "is_direct",
    "renewing",
    "safe_release",
    "sent_key",
    "sent_lease",
    "with_key",
]

log = logging.getLogger(__name__)

#: Message header carrying the key a send locked, so that the execution releases that key.
KEY_HEADER = "singletask_compat_key"

#: Message header carrying the lifetime (seconds) the send gave the lock, which the execution
#: renews as a lease.
LEASE_HEADER = "singletask_compat_lease"


def with_key(options: Mapping[str, Any], key: str, lease: float | None = None) -> dict[str, Any]:
    """Send ``options`` with the locked ``key`` (and its ``lease``) in their headers (as given
    when the headers are not a mapping: then the worker rebuilds the key, as the old library
    did)."""
    sent = with_header(options, KEY_HEADER, key)
    if sent is not None and lease is not None:
        sent = with_header(sent, LEASE_HEADER, lease)
    return sent if sent is not None else dict(options)


def sent_key(request: Any) -> str | None:
    """The key the send of the executing message locked, or None (not sent by a compat base)."""
    value = header_value(request, KEY_HEADER)
    return value if isinstance(value, str) else None


def sent_lease(request: Any, default: float | None) -> float | None:
    """The lock lifetime the send gave, else ``default``."""
    value = header_value(request, LEASE_HEADER)
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default
    )


def is_direct(request: Any) -> bool:
    """Whether the task is called as a function (``task(x)``), not executed for a message:
    no lock then, and no store is touched."""
    return bool(request.called_directly) or request.id is None


def guarded_call(
    task: Any,
    body: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    key_for: Callable[[Sequence[Any], Mapping[str, Any]], str],
    take: Callable[[str], Any],
    release: Callable[[str], None],
    on_duplicate: Callable[[Any], Any],
    release_at_end: bool = True,
    renew: Callable[[str], None] | None = None,
    lease: float | None = None,
) -> Any:
    """Run ``body`` as an execution of ``task`` that holds its key, and release it at the end.

    ``take(key)`` tries the lock: None when taken, else what refused it (the old library's
    exception, say), which ``on_duplicate`` turns into the execution's result (or raises).
    A retry of an execution (``retries`` > 0) and a message whose send took the lock already
    hold it. ``release`` is called at every ending but a retry, unless ``release_at_end`` is
    False; it never lets an error out. With ``renew`` and a ``lease`` (seconds), ``renew(key)``
    is called every third of the lease while the body runs.
    """
    request = task.request
    if is_direct(request):
        return body(*args, **kwargs)
    sent = sent_key(request)
    key = sent or key_for(args, kwargs)
    # Taken here only in a worker: an eager message without the header is ``task.apply()``,
    # which runs the body here and now, as under the old library (and frees the key after).
    if sent is None and not request.retries and not request.is_eager:
        refusal = take(key)
        if refusal is not None:
            return on_duplicate(refusal)
    retried = False
    try:
        with renewing(renew, key, lease):
            return body(*args, **kwargs)
    except Retry:
        retried = True
        raise
    finally:
        if release_at_end and not retried:
            safe_release(release, key)


def safe_release(release: Callable[[str], None], key: str) -> None:
    """Release ``key``; a store error is logged, never raised (the task's result stands)."""
    try:
        release(key)
    except Exception:  # a release must never change how the task ended
        log.exception("singletask.compat: could not release %r", key)


#: Shortest wait between two renewals of a lease, in seconds.
MIN_RENEW_EVERY = 0.2


@contextmanager
def renewing(renew: Callable[[str], None] | None, key: str, lease: float | None) -> Iterator[None]:
    """Call ``renew(key)`` every third of ``lease`` seconds in a thread while the block runs
    (nothing without both); a failed renewal is logged, and the next one tried."""
    if renew is None or not lease or lease <= 0:
        yield
        return
    stop = threading.Event()
    every = max(MIN_RENEW_EVERY, lease / 3)

    def loop() -> None:
        while not stop.wait(every):
            try:
                renew(key)
            except Exception:  # the body goes on; the lease may run out
                log.warning("singletask.compat: could not renew %r", key, exc_info=True)

    thread = threading.Thread(target=loop, name=f"singletask-compat-renew:{key}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def option_dict(
    cls: type, attribute: str, known: frozenset[str]
) -> tuple[str, Mapping[str, Any]] | None:
    """The task class's own ``attribute`` (a dict of the old library's options) and the task's
    name, or None when the class sets none; a value that is no dict, or names an option the
    old library lacks, is refused naming the task, the attribute and the keys it knows."""
    options = cls.__dict__.get(attribute)
    if options is None:
        return None
    name = cls.__dict__.get("name") or cls.__qualname__
    if not isinstance(options, Mapping):
        raise ConfigurationError(f"task {name}: {attribute} must be a dict, got {options!r}")
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigurationError(
            f"task {name}: {attribute} has unknown keys {unknown}; known: {sorted(known)}"
        )
    return name, options

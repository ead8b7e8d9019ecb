"""How an execution takes its lock: the key itself, or one of its ``lock_limit`` holder slots,
and with ``lock_rate`` only when the key's last start is far enough back.

:mod:`singletask.execution.lifecycle` calls these around its acquire: :func:`take` (one request to
the store), :func:`gone_holder` (a holder on this host whose process is gone, to take over at
once), :func:`waits_for_rate` (a start allowed within :data:`RATE_WAIT` is waited for here
rather than through the broker) and :func:`twin_of` (a redelivered copy of a message that
runs in another slot must not take a second one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from ..protocol.headers import is_redelivery
from ..protocol.slots import slot_keys
from ..protocol.tokens import holder_gone

if TYPE_CHECKING:
    from ..backends.base import AcquireResult, Holder, LockBackend, Units
    from ..conf.options import LockOptions

__all__ = ["RATE_WAIT", "gone_holder", "take", "twin_of", "waits_for_rate"]

#: The longest an execution refused by its ``lock_rate`` waits in its own process, with the
#: ``"retry"`` policy, for the start to be allowed, before acquiring once more.
RATE_WAIT: Final = 0.25


def take(
    backend: LockBackend,
    options: LockOptions,
    key: str,
    token: str,
    meta: Mapping[str, str],
    takeover: str | None,
    units: Sequence[Units] = (),
) -> AcquireResult:
    """Acquire ``key`` for ``token``, in one request: the key itself (the singleton's path), or
    one of its slots, the rate checked in the same atomic step, with the ``units`` of named
    limits where the store can (passed only when there are some: a store of one's own written
    before named limits takes no ``units``)."""
    with_units: dict[str, Any] = {"units": units} if units else {}
    if options.limit == 1 and options.rate_interval is None:
        return backend.acquire(
            key, token, options.ttl, meta=meta, takeover_prefix=takeover, **with_units
        )
    return backend.acquire_slot(
        key, options.limit, token, options.ttl, meta=meta, takeover_prefix=takeover,
        interval=options.rate_interval, **with_units,
    )  # fmt: skip


def gone_holder(result: AcquireResult) -> Holder | None:
    """A holder of the refused key whose process, on this host, is gone (a process found
    alive is taken to be alive for :data:`~singletask.protocol.tokens.ALIVE_FOR` seconds)."""
    for holder in result.holders or ((result.holder,) if result.holder else ()):
        if holder_gone(holder.token):
            return holder
    return None


def waits_for_rate(result: AcquireResult, options: LockOptions, request: Any, direct: bool) -> bool:
    """Whether a start refused by the rate waits here (see :data:`RATE_WAIT`): with the
    ``"retry"`` policy, and for a retried attempt of the body, which waits whatever the policy
    (see :func:`singletask.execution.outcomes.refused`)."""
    return (
        result.retry_after is not None
        and result.retry_after <= RATE_WAIT
        and (options.policy == "retry" or int(request.retries or 0) > 0)
        and not direct
        and not request.is_eager
    )


def twin_of(
    backend: LockBackend, options: LockOptions, request: Any, lock_key: str, held: str
) -> Holder | None:
    """With ``lock_limit`` above 1: another slot of ``lock_key`` held by this very message.

    The singleton sees such a copy as a conflict on its one key; with several slots the copy
    would take a free one. Only a redelivered message can have a twin, so only then are the
    other slots read (one request each). Returns that holder, or None.
    """
    if request.id is None or not is_redelivery(request):
        return None
    for slot in slot_keys(lock_key, options.limit):
        if slot != held:
            holder = backend.holder(slot)
            if holder is not None and holder.task_id == request.id:
                return holder
    return None

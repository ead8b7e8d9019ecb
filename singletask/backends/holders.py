"""What a lock store answers about a lock, and the bounds of a lease it accepts.

:class:`Holder` and :class:`AcquireResult` are the values of the store contract,
:class:`singletask.backends.base.LockBackend`, which exports them as well (every store and its
caller import them from there); :data:`MAX_LEASE` and :func:`check_lease` bound every lease a
store writes. They live here, at the bottom of the package, so that the contract's module holds
the contract alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..exceptions import ConfigurationError

__all__ = ["MAX_LEASE", "STATE_KINDS", "AcquireResult", "Holder", "StoreState", "check_lease"]

#: The longest lease, in seconds, any backend accepts (366 days). It is far above every lease
#: the task options allow (each at most 30 days; a queue reservation adds the message's
#: countdown, and is capped here), and far below what the stores can represent.
MAX_LEASE = 366 * 24 * 3600.0


def check_lease(ttl: object, operation: str = "lease") -> float:
    """Return ``ttl`` as float seconds if it is a finite number in (0, MAX_LEASE].

    Backends call it before they write anything, so no record is ever written without an
    expiry the store can represent.

    Raises:
        ConfigurationError: ``ttl`` is not such a number; the message names the operation.
    """
    if (
        isinstance(ttl, bool)
        or not isinstance(ttl, int | float)
        or not math.isfinite(ttl)
        or not 0 < ttl <= MAX_LEASE
    ):
        raise ConfigurationError(
            f"{operation}: a lease must be a finite number of seconds above 0 and at most "
            f"{MAX_LEASE:.0f} (366 days), got {ttl!r}"
        )
    return float(ttl)


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as the backend saw it.

    Attributes:
        token: The holder's owner token.
        task_id: The holder's task id, when it stored one.
        ttl: Seconds left on the lease, when known.
        meta: Every metadata field stored with the lock (``task_id``, ``task``, ``hostname``,
            ``pid``, ``since``), as strings. Empty when the backend returned only the essentials.
        fence: The holder's fencing token, when known.
    """

    token: str
    task_id: str | None = None
    ttl: float | None = None
    meta: Mapping[str, str] = field(default_factory=dict)
    fence: int | None = None


@dataclass(frozen=True)
class AcquireResult:
    """The outcome of :meth:`LockBackend.acquire`.

    Attributes:
        acquired: True when the caller holds the lock now.
        holder: When not acquired, who holds it (from the same atomic step).
        fence: When acquired, the fencing token of this acquisition: strictly greater than every
            token issued earlier for the key (see :meth:`LockBackend.acquire`).
        completed: When acquired, the marker the key's last normal release recorded (see
            :meth:`LockBackend.release`), if the store still remembers one.
        key: When acquired by :meth:`LockBackend.acquire_slot`, the store key of the slot
            taken (renew and release that one).
        holders: When :meth:`LockBackend.acquire_slot` found every slot held, every holder,
            slot 0 first (``holder`` is the first of them).
        retry_after: When :meth:`LockBackend.acquire_slot` was refused by its ``interval``
            (a slot was free, the key started too recently): seconds until a start is allowed.
    """

    acquired: bool
    holder: Holder | None = None
    fence: int | None = None
    completed: str | None = None
    key: str | None = None
    holders: tuple[Holder, ...] = ()
    retry_after: float | None = None


#: The kinds of bookkeeping record :meth:`LockBackend.iter_state
#: <singletask.backends.base.LockBackend.iter_state>` yields: a pending follow-up claim
#: (``claim_next``), a debounce window (``debounce``), a rate record (``lock_rate``).
STATE_KINDS = ("follow_up", "window", "rate")


@dataclass(frozen=True)
class StoreState:
    """One bookkeeping record of a lock key, as the store holds it (see ``STATE_KINDS``).

    Attributes:
        kind: ``"follow_up"``, ``"window"`` or ``"rate"``.
        key: The lock key the record belongs to (not the store key it is kept under).
        task_id: follow_up: the waiting task id; window: its latest send; rate: None.
        ttl: Seconds left before the record runs out (follow_up: the claim; window: its
            record, which outlives the window's last countdown; rate: until the key's next
            start is allowed), when the store says.
        detail: Kind-specific JSON values: window: ``open`` (bool: False once its latest
            send's run closed it) and ``age`` (seconds since it opened, by the store's clock;
            None when closed); rate: ``next_start_in`` (seconds until a start is allowed).
    """

    kind: str
    key: str
    task_id: str | None = None
    ttl: float | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)

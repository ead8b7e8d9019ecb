"""Held leases and the per-process renewer that keeps them alive.

A :class:`LockHandle` is the lock an execution holds (``self.lock`` in the task body). While the
body runs, the process's :class:`Renewer` extends every handle it was given, all of them in one
backend round trip, every third of the shortest lease. A renewal that finds the lock gone or owned
by someone else marks the handle lost at once; while the backend cannot be reached, the handle
counts as lost as soon as its lease has passed without a successful renewal.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .exceptions import BackendError, ConfigurationError, LockLost, LockPreempted

if TYPE_CHECKING:
    from .backends.base import LockBackend, Units

__all__ = ["LockHandle", "Renewer", "native_threads"]

logger = logging.getLogger("singletask")

#: Seconds between renewal attempts while the backend is failing (bounded by a third of the lease).
RETRY_INTERVAL = 1.0

#: Seconds the renewer thread of a worker process waits with nothing to renew before it ends
#: (less with leases shorter than three times this: a third of the shortest), so that a busy
#: worker's executions share one thread. Outside a worker it ends with its last lease.
IDLE_EXIT = 10.0

#: Seconds :meth:`Renewer.stop` waits for an idle thread to end.
STOP_WAIT = 1.0

#: The clock-drift margin a holder takes off every lease it believes in: the share of the lease
#: by which its monotonic clock may run slower than the store's (1 %), plus a fixed allowance
#: for the clock readings themselves (2 ms): the rule of careful lease clients (Redlock's).
DRIFT_FACTOR = 0.01
DRIFT_MIN = 0.002


def drift_margin(ttl: float) -> float:
    """Seconds by which a holder's believed lease of ``ttl`` seconds ends before the store's."""
    return ttl * DRIFT_FACTOR + DRIFT_MIN


#: Serialises LockHandle.lose() (rare: a loss is reported once, from whichever thread sees it).
_LOSS_MUTEX = threading.Lock()


class LockHandle:
    """The lock held by the running execution: ``self.lock`` inside the task body.

    Attributes:
        key: The lock key.
        token: The owner token stored with the lock.
        task_id: The holding execution's task id (None for a direct call).
        fence: The fencing token of this acquisition: greater than every earlier one of the key.
            Hand it to the resource you protect and have it reject smaller ones.
        acquired_at: When the lock was acquired (``time.time()``).
        ttl: The lease, in seconds.
        sent_at: ``time.monotonic()`` taken just before the acquire request was sent (None: now).
            The store starts the lease at some moment after it, so the holder's deadline,
            ``sent_at + ttl - drift_margin(ttl)``, ends no later than the store's lease.
        max_hold: Seconds after which renewal stops (None: no cap).
        preemptible: ``lock_policy = "replace"``: a newer execution may take the lock over;
            the renewer then tells the handle who did (one read, only after a failed renewal).
        successor: Once preempted, the task id of the execution that took the lock over.
    """

    def __init__(
        self,
        key: str,
        token: str,
        task_id: str | None,
        fence: int | None,
        ttl: float,
        *,
        max_hold: float | None = None,
        on_lost: Callable[[LockHandle, str], None] | None = None,
        sent_at: float | None = None,
        preemptible: bool = False,
        units: tuple[Units, ...] = (),
        charge: Callable[[str, int], None] | None = None,
        task: str | None = None,
    ) -> None:
        self.key = key
        self.task = task
        #: The concurrency units of named limits held with the key, renewed with its lease.
        self.units = units
        self._charge = charge
        self.preemptible = preemptible
        self.successor: str | None = None
        self.preempted = False
        self.token = token
        self.task_id = task_id
        self.fence = fence
        self.ttl = ttl
        self.max_hold = max_hold
        self.acquired_at = time.time()
        self._on_lost = on_lost
        self._started = time.monotonic() if sent_at is None else sent_at
        # The monotonic deadline of the current lease, as the holder may believe in it.
        self._expires = self._started + ttl - drift_margin(ttl)
        self._lost: str | None = None
        self._notified = False

    def __repr__(self) -> str:
        state = f"lost: {self._lost}" if self.lost else "held"
        return f"<LockHandle {self.key!r} fence={self.fence} {state}>"

    @property
    def lost(self) -> bool:
        """Whether the lock may now be held by someone else.

        It becomes True when a renewal finds the lock gone or taken, or when the lease has run
        out without a renewal, and then stays True.
        """
        return self.lost_reason is not None

    @property
    def lost_reason(self) -> str | None:
        """Why the lock counts as lost, or None while it is held."""
        if self._lost is None and time.monotonic() >= self._expires:
            # Noticed here first (the renewer may be blocked on an unreachable store, or not
            # renewing at all): report it now, once, as a loss found by a renewal is.
            self.lose("its lease ran out without a renewal")
        return self._lost

    def check(self) -> None:
        """Raise :class:`~singletask.LockLost` if the lock is lost; do nothing while it is held.

        Call it before work that must not happen twice at once, e.g. before committing.
        """
        reason = self.lost_reason
        if reason is not None and self.preempted:
            raise LockPreempted(self.key, reason, self.successor)
        if reason is not None:
            raise LockLost(self.key, reason)

    def charge(self, name: str, units: int) -> None:
        """Count ``units`` instead of the estimated cost in the rate of limit ``name`` (of
        ``lock_limits``), for this execution's start: call it once the body knows what the
        work really cost (the tokens a model call used). The start keeps its time; the rate's
        next starts see the new count. Call it again to correct it; 0 takes the start back.

        Raises:
            ConfigurationError: This execution started no rate of limit ``name``, or
                ``units`` is not a whole number from 0.
            BackendError: The lock store failed.
        """
        if self._charge is None:
            raise ConfigurationError(
                f"lock {self.key!r}: charge({name!r}, ...): this execution names no limits "
                "(lock_limits)"
            )
        self._charge(name, units)

    def renewed(self, at: float) -> None:
        """The lease was extended by a request sent at monotonic time ``at``."""
        self._expires = max(self._expires, at + self.ttl - drift_margin(self.ttl))

    def preempt(self, successor: str | None) -> str:
        """Record that a newer execution, ``successor``, took the lock over; returns the reason
        to report (the loss itself is reported by :meth:`lose`)."""
        self.successor, self.preempted = successor, True
        who = successor or "a direct call"
        return f"preempted by a newer execution ({who}), lock_policy 'replace'"

    def lose(self, reason: str) -> None:
        """Mark the lock lost and tell the owner (once)."""
        with _LOSS_MUTEX:
            if self._notified:
                return
            self._notified = True
            if self._lost is None:
                self._lost = reason
        if self._on_lost is not None:
            self._on_lost(self, self._lost)

    @property
    def hold_expired(self) -> bool:
        """True once the handle has been held ``max_hold`` seconds."""
        return self.max_hold is not None and time.monotonic() - self._started >= self.max_hold


def native_threads() -> tuple[Callable[..., Any], Callable[[], Any]] | None:
    """``(start_new_thread, allocate_lock)`` of the OS when gevent or eventlet has monkey-patched
    threading in this process (their ``threading.Thread`` is then a green thread); else None."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        start, allocate = monkey.get_original("_thread", ["start_new_thread", "allocate_lock"])
        return start, allocate
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        original = patcher.original("_thread")
        return original.start_new_thread, original.allocate_lock
    return None


class Renewer:
    """Extends the leases of one process, in one round trip per interval, from a daemon thread.

    One renewer serves every lock its backend holds in the process; it starts its thread on the
    first lease it is given. Outside a worker the thread ends with the last lease it renews:
    :meth:`remove` of that lease waits (up to ``STOP_WAIT`` seconds) for it to end, so no thread
    outlives an eager execution or a direct call. In a worker process (``linger``, set when the
    worker starts) the thread waits :data:`IDLE_EXIT` seconds (a third of the shortest lease,
    if less) for the next lease, so that back-to-back executions share one thread, and ends at
    once when the worker shuts down. Either way it ends on :meth:`stop` (when the app is closed
    or collected), and the next lease starts a new one. A forked child gets a new renewer,
    since threads do not survive ``fork()``.

    Under gevent or eventlet (monkey-patched threading), given ``connect``, the thread is an OS
    thread that renews through a backend of its own, built by ``connect`` in that thread (a
    connection made on one thread's hub cannot be used from another's). A body that does not
    yield to the hub for a while therefore does not hold renewal up, and renewal never waits on
    the workers' hub. Without ``connect`` it is a green thread, which renews only when the body
    yields.

    The thread sleeps until the next renewal is due; with nothing to renew, until it is due to
    end. Adding a lease wakes it only if that lease must be renewed before the thread would wake
    anyway, so a stream of short executions costs the thread nothing: their leases are added and
    removed while it sleeps, and it lives on as long as they come more often than it ends.
    """

    def __init__(
        self,
        backend: LockBackend,
        *,
        connect: Callable[[], LockBackend] | None = None,
        linger: bool = False,
    ) -> None:
        # A worker's renewer: with nothing to renew, the thread waits for the next lease.
        self.linger = linger
        self._backend = backend
        self._connect = connect
        self._native = native_threads() if connect is not None else None
        allocate = self._native[1] if self._native is not None else threading.Lock
        self._leases: dict[str, LockHandle] = {}
        # Preemptible handles past their lock_max_hold: no longer renewed, but their preemption
        # record is read every third of their lease until it ends (token -> handle, next read).
        self._watched: dict[str, tuple[LockHandle, float]] = {}
        # Both are OS locks under gevent/eventlet with ``connect``: held only briefly, never
        # across I/O. The bell is released (by add()) to wake the thread before its time.
        self._mutex = allocate()
        self._bell = allocate()
        self._bell.acquire()
        self._running = False
        self._thread: threading.Thread | None = None  # None for an OS thread under gevent
        self._ending = False  # stop() was called: end as soon as there is nothing to renew
        self._idle_since: float | None = None  # when the thread last found nothing to renew
        self._pid = os.getpid()
        self._retry_at = 0.0
        self._shortest = math.inf  # the shortest lease given so far, in seconds
        self._wakes_at = math.inf  # monotonic time at which the sleeping thread wakes

    def add(self, handle: LockHandle) -> None:
        """Start renewing ``handle`` until :meth:`remove`, loss, or its ``max_hold``."""
        with self._mutex:
            self._leases[handle.token] = handle
            self._shortest = min(self._shortest, handle.ttl)
            self._ending = False  # in use again
            if not self._running:
                self._running = True
                self._idle_since = None
                if self._native is not None:
                    self._thread = None
                    self._native[0](self._run, ())
                else:
                    thread = threading.Thread(target=self._run, name="singletask-renewer")
                    thread.daemon = True
                    self._thread = thread
                    thread.start()
            elif handle._expires - handle.ttl + handle.ttl / 3 < self._wakes_at:
                self._ring()  # its first renewal is due before the thread would wake

    def remove(self, handle: LockHandle) -> None:
        """Stop renewing ``handle``; call it before releasing (no renewal starts after it).

        The last lease of a renewer that does not ``linger`` ends the thread: this waits for it
        (up to ``STOP_WAIT`` seconds, and no longer once another lease arrives)."""
        with self._mutex:
            self._leases.pop(handle.token, None)
            self._watched.pop(handle.token, None)
            if self._leases or self._watched:
                return
            if not self.linger:
                self._ending = True
            if not self._ending:
                return
            self._ring()  # stopped meanwhile, or not a worker's: the thread ends now
            thread = self._thread
        if not self.linger:
            self._join(thread, STOP_WAIT)

    def _join(self, thread: threading.Thread | None, timeout: float) -> None:
        """Wait for an ending ``thread`` to end, at most ``timeout`` seconds, and no longer
        than it is ending (an add() meanwhile keeps it)."""
        if thread is None or thread is threading.current_thread():
            return
        deadline = time.monotonic() + timeout
        # Ending until it has returned (it then drops itself as the thread), unless an add()
        # meanwhile kept it (still the thread, no longer ending).
        while thread.is_alive() and (self._ending or self._thread is not thread):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            thread.join(min(left, 0.05))

    def stop(self, timeout: float = STOP_WAIT) -> None:
        """End the thread as soon as it has nothing to renew: at once if it has nothing now
        (then wait up to ``timeout`` seconds for it to end), else when its last lease is
        removed. A later :meth:`add` starts a new thread. Does nothing in a process other than
        the one that made the renewer (a forked child: the thread is not there).

        It takes no lock (it may run in a garbage collection, in any thread, even one holding
        the renewer's mutex).
        """
        if os.getpid() != self._pid:
            return
        self._ending = True
        self._ring()
        thread = self._thread
        busy = self._leases or self._watched
        if thread is not None and not busy and thread is not threading.current_thread():
            thread.join(timeout)

    def _ring(self) -> None:
        """Wake the thread (a wake already pending is enough)."""
        with contextlib.suppress(RuntimeError):  # released by another caller meanwhile
            if self._bell.locked():
                self._bell.release()

    def _due(self, now: float) -> float:
        """Seconds until the next round (there is something to renew or watch)."""
        watch = min((at for _, at in self._watched.values()), default=math.inf)
        if not self._leases:
            return watch - now
        interval = min(handle.ttl for handle in self._leases.values()) / 3
        oldest = min(handle._expires - handle.ttl for handle in self._leases.values())
        return min(max(oldest + interval, self._retry_at), watch) - now

    def _run(self) -> None:
        ended = False
        own: LockBackend | None = None
        try:
            if self._native is not None and self._connect is not None:
                own = self._backend = self._connect()  # connections of this thread's own
            self._loop()
            ended = True  # _loop has cleared _running itself, under the mutex
        except Exception:  # never expected
            logger.exception("the lease renewer stopped")
        finally:  # the next add() starts a new thread
            if not ended:
                with self._mutex:
                    self._running = False
            if own is not None:
                with contextlib.suppress(Exception):
                    own.close()  # the next thread connects again

    def _idle(self, now: float) -> float | None:
        """With nothing to renew: seconds to wait for a lease, or None when the thread ends
        now (stopped, or idle for its whole wait); then it is no longer running."""
        if self._idle_since is None:
            self._idle_since = now
        wait = self._idle_since + min(IDLE_EXIT, self._shortest / 3) - now
        if self._ending or wait <= 0:
            self._running = self._ending = False
            self._thread = None
            return None
        return wait

    def _loop(self) -> None:
        while True:
            with self._mutex:
                now = time.monotonic()
                if self._leases or self._watched:
                    self._idle_since = None
                    wait = self._due(now)
                else:
                    idle = self._idle(now)
                    if idle is None:
                        return  # the next add() starts a new thread
                    wait = idle
                if wait > 0:
                    self._wakes_at = now + wait
                    sleep: float | None = min(wait, 3600.0)
                else:
                    sleep = None
            if sleep is not None:
                self._bell.acquire(timeout=sleep)  # returns early when add() rings
                continue
            with self._mutex:
                # Awake: it looks at the leases again before it sleeps, so add() need not ring.
                self._wakes_at = -math.inf
                batch = list(self._leases.values())
                for handle in batch:
                    if handle.hold_expired:
                        del self._leases[handle.token]
                        logger.warning(
                            "lock %r reached lock_max_hold (%ss): renewal stopped, its lease "
                            "ends within %ss",
                            handle.key,
                            handle.max_hold,
                            handle.ttl,
                        )
                        if handle.preemptible:  # it still learns of a preemption in time
                            self._watched[handle.token] = (handle, now)
                batch = [handle for handle in batch if handle.token in self._leases]
                watch = [h for h, at in self._watched.values() if at <= now]
                for handle in watch:
                    self._watched[handle.token] = (handle, now + handle.ttl / 3)
            if batch and time.monotonic() >= self._retry_at:
                self._renew(batch)
            for handle in watch:
                self._watch(handle)

    def _renew(self, batch: list[LockHandle]) -> None:
        sent = time.monotonic()
        try:
            results = self._backend.extend_many([(h.key, h.token, h.ttl) for h in batch])
        except BackendError as exc:
            shortest = min(handle.ttl for handle in batch)
            self._retry_at = time.monotonic() + min(RETRY_INTERVAL, shortest / 3)
            for handle in batch:
                if handle.lost:  # the lease has passed without a successful renewal
                    self._drop(handle, f"its lease ran out while renewals failed: {exc}")
            logger.warning("could not renew %d lock(s), retrying: %s", len(batch), exc)
            return
        except Exception:  # never let the renewer thread die
            logger.exception("renewing %d lock(s) failed", len(batch))
            self._retry_at = time.monotonic() + RETRY_INTERVAL
            return
        self._retry_at = 0.0
        for handle, extended in zip(batch, results, strict=True):
            if extended and handle.units:
                extended = self._renew_units(handle)
            if extended and not handle.lost:
                handle.renewed(sent)
            elif extended:  # renewed too late: someone may have held the lock meanwhile
                self._drop(handle, handle.lost_reason or "its lease ran out")
            else:
                self._drop(handle, self._why_gone(handle))

    def _renew_units(self, handle: LockHandle) -> bool:
        """Renew the units ``handle`` holds of named limits (taking them again is their
        renewal); whether they are still its own."""
        meta = {"task_id": handle.task_id} if handle.task_id else {}
        if handle.task:
            meta["task"] = handle.task
        try:
            return self._backend.take_units(handle.token, handle.ttl, handle.units, meta=meta).taken
        except BackendError:
            return True  # as a failed extend: tried again, the lease decides
        except Exception:
            logger.exception("renewing the units of %r failed", handle.key)
            return True

    def _watch(self, handle: LockHandle) -> None:
        """One read of the preemption record of ``handle``, a preemptible lease past its
        ``lock_max_hold`` (renewed no more): a preemption is reported as a renewal would have
        found it, within a third of the lease; the watch ends with the lease (the handle then
        reports its loss itself) or at the first read that names a successor."""
        if handle.lost:  # its lease has ended: nothing left to learn
            with self._mutex:
                self._watched.pop(handle.token, None)
            return
        try:
            successor = self._backend.replaced_by(handle.key, handle.token)
        except Exception:  # read again at the next round
            logger.warning("could not read the preemption record of lock %r", handle.key)
            return
        if successor is None:
            return
        with self._mutex:
            if self._watched.pop(handle.token, None) is None:
                return  # released meanwhile: not a loss
        handle.lose(handle.preempt(successor or None))

    def _why_gone(self, handle: LockHandle) -> str:
        """Why a renewal found ``handle``'s lock gone: for a preemptible one, one read of the
        store's preemption record tells a preemption (even by an execution that has ended
        since) from a loss."""
        reason = "a renewal found it gone or held by another owner"
        if handle.preemptible:
            try:
                successor = self._backend.replaced_by(handle.key, handle.token)
            except Exception:  # the loss is reported all the same, without its successor
                return reason
            if successor is not None:
                return handle.preempt(successor or None)
        return reason

    def _drop(self, handle: LockHandle, reason: str) -> None:
        with self._mutex:
            if self._leases.pop(handle.token, None) is None:
                return  # released meanwhile: not a loss
        handle.lose(reason)

"""The Celery app of the interaction campaign, on both sides (``celery -A
tests.campaigns.interactions.app worker`` and the test's producers), with one task per drawn
configuration.

Every task runs :func:`body`, which records its start and its end in the probe (a list on a
private Redis database: args, task id, attempt, pid, fence, time, when its acquire was sent and
the units it took of each named limit) and then ends the way its send asked: return, raise,
``self.retry()`` with a countdown, ``Ignore``, ``Reject``, a soft or hard time limit (the send
sets the limit, the body outlasts it), or a killed pool child (the body sends itself SIGKILL,
once per task id: a redelivered copy returns). A body whose send drew a ``charge`` and that
started a rate of a named limit calls ``self.lock.charge`` halfway through its work, and records
the call (its units, and the times just before and just after it).

In the worker, every refusal singletask reports (``lock_conflict``) is recorded too: the
attempt, the key argument, the holder met (none for a limit without room) and the action.

The app's ``singletask_limits`` are the campaign's named limits (space.LIMITS), in every lock
store: the configurations of one store share them.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Ignore, Reject
from kombu import Exchange, Queue

from singletask import SingletonTask
from singletask.signals import lock_conflict

from .space import LIMITS, Config

#: Environment of the worker subprocess (and of a producer subprocess).
ENV_CONFIGS = "SINGLETASK_INTERACTIONS_CONFIGS"
ENV_BROKER = "SINGLETASK_INTERACTIONS_BROKER"
ENV_RESULTS = "SINGLETASK_INTERACTIONS_RESULTS"
ENV_LOCKS = "SINGLETASK_INTERACTIONS_LOCKS"
ENV_PROBE = "SINGLETASK_INTERACTIONS_PROBE"
ENV_QUEUE = "SINGLETASK_INTERACTIONS_QUEUE"
ENV_PREFIX = "SINGLETASK_INTERACTIONS_PREFIX"
#: Of a producer subprocess: each store's configurations, store URL and queue (JSON).
ENV_GROUPS = "SINGLETASK_INTERACTIONS_GROUPS"

#: How long the probe's records stay (they are read right after the run).
PROBE_TTL = 3600

ENDINGS = ("return", "raise", "retry", "ignore", "reject", "soft", "hard", "kill")


def probe_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


_probes: dict[int, redis.Redis] = {}


def _probe() -> redis.Redis:
    pid = os.getpid()
    if pid not in _probes:
        _probes.clear()
        _probes[pid] = probe_client(os.environ[ENV_PROBE])
    return _probes[pid]


def events_key(run: str) -> str:
    return f"interactions:{run}:events"


def _record(run: str, event: str, **fields: Any) -> None:
    client = _probe()
    payload = json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **fields})
    with client.pipeline(transaction=False) as pipe:
        pipe.rpush(events_key(run), payload)
        pipe.expire(events_key(run), PROBE_TTL)
        pipe.execute()


#: The configuration of each task registered in this process, by task name.
CONFIGS: dict[str, Config] = {}


def acquire_sent(lock: Any) -> float | None:
    """When (``time.time()``) the request that acquired ``lock`` was sent: no store step of the
    execution (its key's acquire, its units' take) is earlier. The handle keeps it as
    ``time.monotonic()`` (lease.py: the lease counts from it)."""
    sent = getattr(lock, "_started", None)
    return None if sent is None else time.time() - (time.monotonic() - sent)


def _charge(lock: Any, run: str, fields: Mapping[str, Any], name: str, units: int) -> None:
    """``lock.charge(name, units)``, recorded with the times just before and just after it."""
    before, error = time.time(), None
    try:
        lock.charge(name, units)
    except Exception as exc:  # a store fault: the charge may or may not have been written
        error = type(exc).__name__
    after = time.time()
    _record(run, "charge", name=name, units=units, before=before, after=after, error=error,
            **{k: fields[k] for k in ("task_id", "retries")})  # fmt: skip


def body(
    self: SingletonTask,
    key: str,
    seq: int,
    ending: str = "return",
    sleep: float = 0.05,
    countdown: float = 0.3,
    run: str = "",
    cost: int = 1,
    charge: int | None = None,
    **payload: Any,
) -> int:
    """A campaign body: record the start, work ``sleep`` seconds (charging a rate halfway when
    the send drew a charge), end as ``ending`` says."""
    request = self.request
    lock = self.lock
    config = CONFIGS.get(self.name)
    fields = {
        "task": self.name,
        "key": key,
        "seq": seq,
        "task_id": request.id,
        "retries": request.retries,
        "fence": lock.fence if lock is not None else None,
        "slot": lock.key if lock is not None else None,
        "ending": ending,
        "redelivered": bool((request.delivery_info or {}).get("redelivered")),
        "acquired": acquire_sent(lock),
        "units": config.costs(cost) if config is not None else {},
    }
    _record(run, "start", **fields)
    how = "unwound"
    try:
        if ending == "kill":
            first = _probe().set(f"interactions:{run}:killed:{request.id}", 1, nx=True, ex=600)
            if first:
                os.kill(os.getpid(), signal.SIGKILL)
        rated = config.rated() if config is not None else []
        if charge is not None and rated and lock is not None:
            time.sleep(sleep / 2)
            _charge(lock, run, fields, rated[0], charge)
            time.sleep(sleep / 2)
        else:
            time.sleep(sleep)
        if ending == "raise":
            how = "raise"
            raise RuntimeError(f"body of send {seq} raised")
        if ending == "retry" and request.retries == 0:
            how = "retry"
            raise self.retry(countdown=countdown, max_retries=1)
        if ending == "ignore":
            how = "ignore"
            raise Ignore()
        if ending == "reject":
            how = "reject"
            raise Reject(f"send {seq} rejected", requeue=False)
        if ending in ("soft", "hard"):
            how = ending
            time.sleep(10)  # the send's time limit ends it
        how = "return"
        return seq
    finally:
        lost = lock is not None and lock.lost
        _record(run, "end", how=how, lost=lost, **{k: v for k, v in fields.items() if k != "units"})


def record_refusal(
    sender: Any = None,
    key: str = "",
    holder: str | None = None,
    task_id: str | None = None,
    action: str = "",
    **_: Any,
) -> None:
    """``lock_conflict`` (connected in the worker): an execution refused, in the probe as a
    ``refused`` event (its attempt, its task's key argument, the holder it met if any, the
    policy's action), so that the checker knows when an execution waited (fair turns)."""
    request = getattr(sender, "request", None)
    if request is None or getattr(sender, "name", None) not in CONFIGS:
        return
    run = (request.kwargs or {}).get("run", "")
    args = request.args or ()
    _record(run, "refused", task=sender.name, task_id=task_id or request.id,
            retries=request.retries, key=args[0] if args else None, lock=key, holder=holder,
            action=action)  # fmt: skip


def register(app: Celery, configs: Sequence[Config]) -> None:
    """One task per configuration, named after its index."""
    for config in configs:
        CONFIGS[config.name] = config
        app.task(
            base=SingletonTask, bind=True, shared=False, name=config.name, max_retries=1,
            **config.task_options(),
        )(body)  # fmt: skip


def make_app(
    *,
    broker: str,
    results: str,
    locks: str,
    queue: str,
    prefix: str,
    configs: Sequence[Config],
    transport_options: Mapping[str, Any] | None = None,
) -> Celery:
    app = Celery("interactions", broker=broker, backend=results, set_as_current=False)
    exchange = Exchange(queue, type="direct", durable=False, auto_delete=True)
    app.conf.update(
        singletask_backend_url=locks,
        singletask_key_prefix=prefix,
        singletask_limits=LIMITS,
        task_queues=[Queue(queue, exchange, routing_key=queue, durable=False, auto_delete=True)],
        task_default_queue=queue,
        task_default_exchange=queue,
        task_default_routing_key=queue,
        task_serializer="json",
        result_serializer="json",
        worker_prefetch_multiplier=1,
        result_expires=3600,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 60, **(transport_options or {})},
        worker_hijack_root_logger=True,
        worker_redirect_stdouts=False,
    )
    register(app, configs)
    return app


def _from_env() -> Celery | None:
    try:
        configs = [Config.from_json(c) for c in json.loads(os.environ[ENV_CONFIGS])]
        return make_app(
            broker=os.environ[ENV_BROKER],
            results=os.environ[ENV_RESULTS],
            locks=os.environ[ENV_LOCKS],
            queue=os.environ[ENV_QUEUE],
            prefix=os.environ[ENV_PREFIX],
            configs=configs,
        )
    except KeyError:
        return None


#: Set in the worker subprocess (which gets the environment variables); None elsewhere.
app = _from_env()
if app is not None:
    # SIGUSR2 makes each process of the worker (its pool processes inherit the handler) write
    # every thread's stack into the log: the runner sends it before it stops the worker, so an
    # execution that never ended shows where it stood. (Billiard's soft limit is SIGUSR1.)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    lock_conflict.connect(record_refusal, weak=False)

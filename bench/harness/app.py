"""The benchmark's Celery app: the same two tasks under every contender.

``celery -A bench.harness.app worker`` builds it from environment variables (see
:func:`_from_env`); the benchmark process builds it with :func:`make_app`. For each variant ``v``
there are:

``bench.<v>.noop(i)``
    An empty body, locked per value of ``i`` (measurements 1 and 2).
``bench.plain.two_pings(i)``
    A plain task whose body sends two ``PING`` commands: what two round trips cost inside an
    execution (a reference for measurement 1).
``bench.<v>.hold(key, mode, token)``
    Locked per ``key`` only (measurements 3 and 4). ``mode`` says what the body does: ``probe``
    (nothing), ``sleep:<s>`` or ``wait:<name>`` (in-process only: block on a local event). A
    body that is not ``probe`` records its process, task id and start time in the probe
    database under ``token``, and counts how many bodies of ``key`` run at once.
``bench.singletask-{limit,rate,debounce}.noop(i)``
    The empty body with ``lock_limit``, ``lock_rate`` or ``lock_debounce`` (``BEYOND``).
``bench.singletask-default.noop(i)``
    The empty body with singletask's default options: one lock per task (``BEYOND``).
``bench.singletask-{units,units-only,units-charge}.noop(i)``
    The empty body with named limits (``BEYOND``, the app's ``LIMITS``): one limit beside the
    key, one limit and no key of its own, or two limits (a concurrency and a rate) and a
    ``charge`` of the rate in the body.
``bench.singletask-fleet.start(i)``
    One key under ``lock_rate`` (``BENCH_FLEET_RATE``): each start records its fencing token.
``bench.singletask-turns.sync(label, tenant, pause, weight)``
    A tenant's sync (suites/turns.py): one unit of ``bench-turns`` (a concurrency of 2), the
    tenant as lock key, ``lock_policy="retry"`` every ``BENCH_TURNS_COUNTDOWN`` seconds,
    ``lock_weight`` the call's ``weight``. Its body records its start and end in the probe
    database (``turns:<label>``). Fair turns are on unless ``BENCH_LIMIT_TURNS`` is ``0``.

In a worker, the ``task_prerun`` / ``task_postrun`` signals write one line per execution to a
file per pool process (``BENCH_TIMES_DIR``), and ``hold`` executions also leave a ``done:``
marker in the probe database saying whether the body ran.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from celery import Celery, Task, current_task, signals

from bench.alternatives import cookbook, only_one

#: Every contender, in report order. ``plain`` is Celery's own Task without any lock.
VARIANTS = [
    "plain",
    "singletask",
    "singletask-queue",
    "celery-singleton",
    "celery-once",
    "celery-heimdall",
    "celery-heimdall-nb",
    "only-one",
    "cookbook",
]

#: The library each variant needs (None: the repository's own code).
REQUIRES = {
    "singletask": "singletask",
    "singletask-queue": "singletask",
    "celery-singleton": "celery_singleton",
    "celery-once": "celery_once",
    "celery-heimdall": "celery_heimdall",
    "celery-heimdall-nb": "celery_heimdall",
}

#: The task options of the beyond suite's variants (not contenders: run never runs them).
#: The rate is high enough never to refuse a key per execution: what it measures is the check.
#: The named limits' variants take 1 unit of limits far larger than what one process can start
#: (``LIMITS``): what they measure is the take and the giving back. ``singletask-units-only``
#: names no key (``lock_args`` None): the limits alone hold it back.
BEYOND: dict[str, dict[str, Any]] = {
    "singletask-default": {"lock_args": None},  # the defaults: one lock per task
    "singletask-limit": {"lock_limit": 5},
    "singletask-rate": {"lock_rate": "1000/s"},
    "singletask-debounce": {"lock_debounce": 1.0},
    "singletask-units": {"lock_limits": ["bench-db"]},
    "singletask-units-only": {"lock_limits": ["bench-db"], "lock_args": None},
    "singletask-units-charge": {"lock_limits": ["bench-requests", "bench-tokens"]},
}

#: The app's named limits (``singletask_limits``), for the ``singletask-units*`` variants.
LIMITS: dict[str, dict[str, Any]] = {
    "bench-db": {"concurrency": 1000},
    "bench-requests": {"concurrency": 1000},
    "bench-tokens": {"rate": "1000000/s"},
    "bench-turns": {"concurrency": 2},
}

#: Where each variant takes its lock: when a worker executes the task, or when it is sent.
LOCK_SIDE = {
    "plain": "none",
    "singletask": "execution",
    "singletask-queue": "send + execution",
    "celery-singleton": "send",
    "celery-once": "send",
    "celery-heimdall": "send + execution",
    "celery-heimdall-nb": "send + execution",
    "only-one": "execution",
    "cookbook": "execution",
}

#: Lock lifetime each variant is configured with (its documented default, or the recipe's).
LOCK_TTL = {
    "plain": None,
    "singletask": 30.0,  # lease, renewed while the body runs
    "singletask-queue": 30.0,
    "celery-singleton": None,  # never expires
    "celery-once": 3600.0,
    "celery-heimdall": 3600.0,
    "celery-heimdall-nb": 3600.0,
    "only-one": 300.0,  # the blog post's timeout=60 * 5
    "cookbook": float(cookbook.LOCK_EXPIRE),
}

logger = logging.getLogger("bench")


def available(variant: str) -> bool:
    module = REQUIRES.get(variant)
    if module is None:
        return True
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def package_version(variant: str) -> str:
    from importlib import metadata

    module = REQUIRES.get(variant)
    if module is None:
        return ""
    if module == "singletask":
        import singletask

        return str(singletask.__version__)
    return metadata.version(module.replace("_", "-"))


# -- the probe database -------------------------------------------------------------------------

_probe: redis.Redis | None = None
_probe_pid: int | None = None

# KEYS[1] bodies of this key running now, KEYS[2] the most seen at once.
_ENTER = """
local now = redis.call('INCR', KEYS[1])
local most = tonumber(redis.call('GET', KEYS[2]) or '0')
if now > most then redis.call('SET', KEYS[2], now) end
return now
"""


def probe() -> redis.Redis:
    global _probe, _probe_pid
    if _probe is None or _probe_pid != os.getpid():
        _probe = redis.Redis.from_url(os.environ["BENCH_PROBE_URL"])
        _probe_pid = os.getpid()
    return _probe


#: In-process holders (``wait:<name>`` mode): name -> (started, release) events.
WAITERS: dict[str, tuple[threading.Event, threading.Event]] = {}

_ran = threading.local()


def noop(i: int) -> None:
    _ran.value = True


_pinger: redis.Redis | None = None


def two_pings(i: int) -> None:
    """A plain task whose body makes two round trips to the lock database (a reference)."""
    global _pinger
    if _pinger is None:
        _pinger = redis.Redis.from_url(os.environ["BENCH_LOCK_URL"])
    _pinger.ping()
    _pinger.ping()
    _ran.value = True


def charged_noop(self: Task, i: int) -> None:
    """The empty body that charges the rate it started 1 unit (its estimate): the request a
    ``charge`` costs."""
    _ran.value = True
    self.lock.charge("bench-tokens", 1)


def fleet_start(self: Task, i: int) -> None:
    """A start under ``lock_rate``: its fencing token (on Redis, the store's clock in
    microseconds when it took the key), this process's clock and pid, in the probe database."""
    _ran.value = True
    probe().rpush("fleet:starts", f"{self.lock.fence} {time.time()!r} {os.getpid()}")


def turns_sync(
    self: Task, label: str, tenant: str, pause: float = 0.25, weight: float = 1.0
) -> None:
    """A tenant's sync under a shared limit: its start and end (tenant, task id, this
    process's clock), in the order the probe database records them, under ``turns:<label>``."""
    _ran.value = True
    client = probe()
    event = {"tenant": tenant, "task_id": str(self.request.id), "pid": os.getpid()}
    client.rpush(f"turns:{label}", json.dumps({**event, "event": "start", "t": time.time()}))
    time.sleep(pause)
    client.rpush(f"turns:{label}", json.dumps({**event, "event": "end", "t": time.time()}))


def _turns_weight(args: Any, kwargs: Any) -> float:
    return float((kwargs or {}).get("weight", 1.0))


def hold(key: str, mode: str = "probe", token: str = "") -> None:
    _ran.value = True
    if mode == "probe":
        return
    client = probe()
    task_id = str(current_task.request.id)
    now = time.time()
    client.hset(
        f"holder:{token}",
        mapping={
            "pid": os.getpid(),
            "task_id": task_id,
            "started": repr(now),
            # When the pool process took the task (task_prerun): its time limits count from
            # about then, before __call__ (and any lock wait in it) runs.
            "prerun": repr(_started.get(task_id, now)),
        },
    )
    client.eval(_ENTER, 2, f"running:{key}", f"most:{key}")
    try:
        if mode.startswith("sleep:"):
            time.sleep(float(mode[len("sleep:") :]))
        elif mode.startswith("wait:"):
            started, release = WAITERS[mode[len("wait:") :]]
            started.set()
            release.wait(60)
    finally:
        client.decr(f"running:{key}")
        client.incr(f"bodies:{key}")


def _hold_key(key: str, mode: str = "probe", token: str = "") -> str:
    return f"only-one:hold:{key}"


def _noop_key(i: int) -> str:
    return f"only-one:noop:{i}"


def _heimdall_hold_key(args: Any, kwargs: Any) -> str:
    key = kwargs["key"] if kwargs and "key" in kwargs else args[0]
    return f"hold:{key}"


# -- registration -------------------------------------------------------------------------------


def _register(app: Celery, variant: str) -> None:
    noop_name, hold_name = f"bench.{variant}.noop", f"bench.{variant}.hold"

    def task(**options: Any) -> Any:
        # Not shared: each app built here gets exactly the tasks registered on it.
        return app.task(shared=False, **options)

    if variant == "plain":
        task(name=noop_name, base=Task)(noop)
        task(name=hold_name, base=Task)(hold)
        task(name="bench.plain.two_pings", base=Task)(two_pings)
    elif variant in ("singletask", "singletask-queue"):
        from singletask import SingletonTask

        scope = "queue" if variant == "singletask-queue" else "execution"
        task(name=noop_name, base=SingletonTask, lock_args="*", lock_scope=scope)(noop)
        task(name=hold_name, base=SingletonTask, lock_args=("key",), lock_scope=scope)(hold)
    elif variant in BEYOND:
        # The options beyond the singleton (suites/beyond.py), on the same per-argument keys.
        from singletask import SingletonTask

        options = {"lock_args": "*", **BEYOND[variant]}
        body = charged_noop if variant == "singletask-units-charge" else noop
        task(name=noop_name, base=SingletonTask, bind=body is charged_noop, **options)(body)
    elif variant == "singletask-fleet":
        # One key for the whole task under a rate: suites/beyond.py's fleet of workers.
        from singletask import SingletonTask

        task(
            name="bench.singletask-fleet.start", base=SingletonTask, bind=True,
            lock_rate=os.environ.get("BENCH_FLEET_RATE", "20/s"), lock_limit=4,
            lock_policy="retry", lock_retry_max=1000, lock_retry_countdown=0.05,
        )(fleet_start)  # fmt: skip
    elif variant == "singletask-turns":
        # Tenants sharing a limit of 2: suites/turns.py.
        from singletask import SingletonTask

        task(
            name="bench.singletask-turns.sync", base=SingletonTask, bind=True,
            lock_limits=["bench-turns"], lock_key="{tenant}", lock_limit=64,
            lock_weight=_turns_weight, lock_policy="retry", lock_retry_max=1000,
            lock_retry_countdown=float(os.environ.get("BENCH_TURNS_COUNTDOWN", "0.5")),
        )(turns_sync)  # fmt: skip
    elif variant == "celery-singleton":
        from celery_singleton import Singleton

        task(name=noop_name, base=Singleton)(noop)
        task(name=hold_name, base=Singleton, unique_on=["key"])(hold)
    elif variant == "celery-once":
        from celery_once import QueueOnce

        task(name=noop_name, base=QueueOnce)(noop)
        task(name=hold_name, base=QueueOnce, once={"keys": ["key"]})(hold)
    elif variant in ("celery-heimdall", "celery-heimdall-nb"):
        base = _heimdall_base()
        options: dict[str, Any] = {"unique": True}
        if variant == "celery-heimdall-nb":
            options["unique_lock_blocking"] = False
        task(name=noop_name, base=base, heimdall=dict(options))(noop)
        task(name=hold_name, base=base, heimdall={**options, "key": _heimdall_hold_key})(hold)
    elif variant == "only-one":
        task(name=noop_name)(only_one.only_one(key=_noop_key, timeout=60 * 5)(noop))
        task(name=hold_name)(only_one.only_one(key=_hold_key, timeout=60 * 5)(hold))
    elif variant == "cookbook":
        task(name=noop_name, bind=True)(_cookbook(noop))
        task(name=hold_name, bind=True)(_cookbook(hold))
    else:
        raise ValueError(f"unknown variant {variant!r}")


def _cookbook(body: Callable[..., Any]) -> Callable[..., Any]:
    """A task function in the shape of the cookbook's ``import_feed``, around ``body``."""

    def task(self: Task, *args: Any, **kwargs: Any) -> Any:
        argument = args[0] if args else next(iter(kwargs.values()))
        lock_key = cookbook.lock_id(self.name, argument)
        with cookbook.cache_lock(lock_key, self.app.oid) as acquired:
            if acquired:
                return body(*args, **kwargs)
        logger.debug("%s %s is already being run by another worker", self.name, argument)
        return None

    task.__name__ = body.__name__
    return task


_heimdall_class: type | None = None


def _heimdall_base() -> type:
    """HeimdallTask pointed at the lock database (its README's way: override setup_redis)."""
    global _heimdall_class
    if _heimdall_class is None:
        from celery_heimdall import HeimdallTask

        class BenchHeimdallTask(HeimdallTask):  # type: ignore[misc]
            def setup_redis(self) -> redis.Redis:
                return redis.Redis.from_url(os.environ["BENCH_LOCK_URL"])

        _heimdall_class = BenchHeimdallTask
    return _heimdall_class


def make_app(
    *,
    broker: str,
    lock_url: str,
    probe_url: str,
    variants: list[str],
    eager: bool = False,
    queue: str = "bench",
    limit_turns: bool = True,
) -> Celery:
    """The benchmark app with the tasks of ``variants`` (all of them must be available)."""
    os.environ["BENCH_LOCK_URL"] = lock_url
    os.environ["BENCH_PROBE_URL"] = probe_url
    only_one.configure(lock_url)
    cookbook.configure(lock_url)
    app = Celery("bench", broker=broker, set_as_current=False)
    app.conf.update(
        task_always_eager=eager,
        task_eager_propagates=eager,
        task_ignore_result=True,
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
        worker_redirect_stdouts=False,
        singletask_backend_url=lock_url,
        singletask_limits=LIMITS,
        singletask_limit_turns=limit_turns,
        singleton_backend_url=lock_url,
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": lock_url, "default_timeout": 60 * 60},
        },
    )
    for variant in variants:
        _register(app, variant)
    return app


# -- worker-side instrumentation ----------------------------------------------------------------

_started: dict[str, float] = {}
_times: Any = None
_times_pid: int | None = None


def _times_file() -> Any:
    global _times, _times_pid
    if _times is None or _times_pid != os.getpid():
        directory = Path(os.environ["BENCH_TIMES_DIR"])
        _times = (directory / f"{os.getpid()}.tsv").open("a", buffering=1)
        _times_pid = os.getpid()
    return _times


def _on_prerun(task_id: str | None = None, **_: Any) -> None:
    _ran.value = False
    _started[str(task_id)] = time.time()


def _on_postrun(
    task_id: str | None = None, task: Any = None, args: Any = None, kwargs: Any = None, **_: Any
) -> None:
    end = time.time()
    ran = int(bool(getattr(_ran, "value", False)))
    start = _started.pop(str(task_id), end)
    name = getattr(task, "name", "?")
    if name == "bench.singletask-turns.sync" and not ran and args:
        # A refused attempt of a tenant's sync (it waits in the limit's line from then on)
        label, tenant = args[0], args[1]
        refusal = {"tenant": tenant, "task_id": str(task_id), "event": "refused", "t": start}
        probe().rpush(f"turns:{label}", json.dumps(refusal))
    if os.environ.get("BENCH_TIMES_DIR"):
        _times_file().write(f"{name}\t{start!r}\t{end!r}\t{ran}\n")
    if name.endswith(".hold") and kwargs:
        client = probe()
        client.set(f"done:{kwargs.get('token', '')}", ran, ex=3600)
        client.incr(f"done:{kwargs.get('key', '')}")


def _on_ready(sender: Any = None, **_: Any) -> None:
    probe().set(f"ready:{sender.hostname}", 1, ex=3600)


def _from_env() -> Celery | None:
    if "BENCH_BROKER_URL" not in os.environ:
        return None
    variants = [v for v in os.environ["BENCH_VARIANTS"].split(",") if v]
    created = make_app(
        broker=os.environ["BENCH_BROKER_URL"],
        lock_url=os.environ["BENCH_LOCK_URL"],
        probe_url=os.environ["BENCH_PROBE_URL"],
        variants=variants,
        limit_turns=os.environ.get("BENCH_LIMIT_TURNS", "1") != "0",
    )
    signals.task_prerun.connect(_on_prerun, weak=False)
    signals.task_postrun.connect(_on_postrun, weak=False)
    signals.worker_ready.connect(_on_ready, weak=False)
    return created


app = _from_env()

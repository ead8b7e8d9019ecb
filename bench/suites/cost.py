"""The cost of a lock, counted: instructions per execution and per refusal, not times.

Valgrind's callgrind counts the instructions (and, on the client, the system calls) of one
private ``redis-server`` and of the client process, so the figures do not move with the load
of a shared machine. Each figure is the difference of two loops of one process, of ``N`` and
``2N`` runs, divided by ``N`` (what a loop costs once, its start and end, cancels out), minus
the same figure for a plain Celery task: what the lock adds.

Every run is ``task.apply_async((i,))`` on the eager path (``task_always_eager``, the worker's
stack protection installed, no result backend, and for singletask the lease renewer's thread
kept between executions as the worker's bootstep keeps it), a no-op body, for:

* ``plain``: Celery's own Task, the reference subtracted from the others;
* ``singletask``: :class:`~singletask.SingletonTask` with its default options (one lock per
  task); the server's rows add ``singletask-args``, with ``lock_args="*"`` (a key per
  argument, 98 characters here);
* ``only-one``: the redis-py ``Lock`` decorator recipe (``bench/alternatives/only_one.py``);
* ``cookbook``: the cookbook's ``cache.add`` recipe, SET NX + DEL
  (``bench/alternatives/cookbook.py``).

Two modes: an **execution** takes a free key (a new one each run) and runs the body; a
**refusal** finds its key held by another live process of this host, for its whole lease (the
only-one and cookbook recipes return None, singletask's default policy returns ``Skipped``).
The server's rows add two references measured the same way: celery-once's refusal (its
``SET NX PX`` refused, then ``PTTL``: the pair of commands it sends), and the floor of any
script, an ``EVALSHA`` of ``return 0`` with one key, and those of a lock record kept as a hash
and as one string (two scripts of the fewest commands that take and owner-check-release it;
and one that reads a string holder and its lease, as a refusal does). Last, the floors of each
design a one-round-trip acquire with a server-made fencing token can take (``DESIGNS``), per
execution and per refusal, with singletask's key and with a one-lock-per-task key, as scripts
and (Redis 7 and later) as functions; ``cost.json``'s ``designs`` says which of issue 41's two
server targets each floor is within (on Redis 6, without the functions and the design that
needs ``SET NX GET``).

Server: one ``redis-server`` under callgrind (``--hz 1``; what its cron costs, if it ran, is
taken out), the loops run natively in this process, a dump (``callgrind_control -d``) around
each loop. Client: each variant and mode in a Python process of its own under callgrind
(``--collect-systime=yes`` counts system calls, but the clock's: natively the vDSO answers
those without one), against a native ``redis-server``; the process
marks each loop's ends by calling ``os.getloadavg()``, before which callgrind dumps
(``--dump-before``), each loop starting and ending with a collection of Python's cyclic
collector (what the warm-up left alive frozen). Needs ``valgrind`` and ``redis-server`` on
PATH. Writes ``cost.json`` and ``cost.rst`` to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench import RESULTS, ROOT

#: The contenders, in report order; ``plain`` is subtracted from the others.
VARIANTS = ("plain", "singletask", "only-one", "cookbook")
#: Measured on the server only: singletask with ``lock_args="*"`` (a key per argument).
SERVER_ONLY = ("singletask-args",)
#: The bench app's variant (bench/harness/app.py) each row runs: ``singletask`` is the default
#: options (one lock per task), ``singletask-args`` the app's ``singletask`` (``lock_args="*"``).
HARNESS = {"singletask": "singletask-default", "singletask-args": "singletask"}
MODES = ("execution", "refusal")

#: Loop lengths: ``N`` runs, then ``2N``; warm-up runs before them.
CONFIGS = {"full": {"runs": 50, "warmup": 50}, "quick": {"runs": 10, "warmup": 10}}

#: Redis takes a step of its Lua collector once every this many scripts or functions (its
#: ``LUA_GC_CYCLE_PERIOD``), some 80k instructions: the server's loops are a multiple of it long,
#: so that each holds as many steps as its length says (with loops of 10 and 20 runs, a step fell
#: in one or the other by where the count stood, and a reference came out negative).
LUA_GC_PERIOD = 50


def server_runs(runs: int) -> int:
    """The length ``N`` of the server's first loop for a client's ``runs``: a multiple of
    :data:`LUA_GC_PERIOD`, at least one."""
    return max(1, -(-runs // LUA_GC_PERIOD)) * LUA_GC_PERIOD


#: The function before which the client's callgrind dumps: nothing in a run calls it.
MARKER = "os_getloadavg"

#: The key every refusal finds held (the argument of its runs).
HELD = 0


def _valgrind(out: Path, *extra: str) -> list[str]:
    return [
        "valgrind", "--tool=callgrind", "--dump-instr=no", "--compress-strings=no",
        f"--callgrind-out-file={out}", *extra,
    ]  # fmt: skip


def _totals(path: Path) -> dict[str, int]:
    """The event totals of one callgrind dump, by event name."""
    events: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("totals:"):
            return dict(zip(events, map(int, line.split()[1:]), strict=False))
    raise RuntimeError(f"no totals in {path}")


def _inclusive(path: Path, function: str, event: str = "Ir") -> int:
    """The ``event`` count of ``function`` and what it called, in one dump (0 if absent)."""
    listing = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", f"--show={event}", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for line in listing.splitlines():
        if re.search(rf":{function}[@ ]", line):
            return int(line.split()[0].replace(",", ""))
    return 0


def _syscalls(path: Path) -> int:
    """The system calls of one client dump, but the clock's: under Valgrind, reading the clock
    is a system call; natively it is not (the vDSO answers it in the process)."""
    return _totals(path).get("sysCount", 0) - _inclusive(path, "clock_gettime", "sysCount")


# -- the runs -----------------------------------------------------------------------------------


def _app(lock_url: str, variants: list[str]) -> Any:
    from celery.app.trace import _install_stack_protection

    from bench.harness import app as bench_app

    # As in a worker process: a task's own __call__ calling super().__call__() goes to run.
    _install_stack_protection()
    app = bench_app.make_app(
        broker="memory://",
        eager=True,
        lock_url=lock_url,
        probe_url=lock_url,
        variants=[HARNESS.get(variant, variant) for variant in variants],
    )
    if "singletask" in variants:
        from bench.harness.app import noop
        from singletask import SingletonTask

        # The refusals of one lock per task meet this task's key, held, not the executions'.
        app.task(name="bench.singletask-default.held", base=SingletonTask, shared=False)(noop)
    if any(variant.startswith("singletask") for variant in variants):
        from singletask.conf.runtime import app_state

        # As the worker's ServeWorker bootstep does: the lease renewer's thread waits for the
        # next execution instead of ending with each one (back-to-back executions share it).
        app_state(app).serve_worker(True)
    return app


def _task(app: Any, variant: str, mode: str) -> Any:
    """The no-op task of row ``variant`` in ``mode``: with one lock per task (``singletask``),
    a refusal's is a second task of the same options, whose key (as long) is the one held."""
    name = f"bench.{HARNESS.get(variant, variant)}.noop"
    if mode == "refusal" and HARNESS.get(variant) == "singletask-default":
        return app.tasks[name.replace(".noop", ".held")]
    return app.tasks[name]


def _runner(app: Any, variant: str, mode: str) -> Callable[[], Any]:
    """One run of ``variant`` in ``mode``: a new argument each execution (a new key, but for
    one lock per task), the held key to refuse."""
    task = _task(app, variant, mode)
    count = iter(range(HELD + 1, 10**9))
    if mode == "refusal":
        return lambda: task.apply_async((HELD,))
    return lambda: task.apply_async((next(count),))


def check_outcome(variant: str, mode: str, outcome: Any) -> None:
    """Raise if a singletask run did not end as its mode says: a refusal is skipped, an
    execution runs (a run measuring the other would count the wrong path)."""
    if not variant.startswith("singletask"):
        return
    from singletask import Skipped

    if isinstance(outcome.result, Skipped) != (mode == "refusal"):
        raise RuntimeError(f"{variant}/{mode}: a run ended {outcome.result!r}")


def hold_keys(app: Any, lock_url: str) -> None:
    """Hold each variant's refused key for ten minutes, as another live process of this host
    (this one) would: what a refusal meets."""
    import redis

    from bench.alternatives import cookbook
    from singletask.backends.redis import RedisBackend
    from singletask.protocol.tokens import execution_token

    client = redis.Redis.from_url(lock_url)
    for variant in ("singletask", *SERVER_ONLY):
        if f"bench.{HARNESS[variant]}.noop" not in app.tasks:
            continue
        name = _task(app, variant, "refusal").name
        key = app.tasks[name].lock_key_for((HELD,))
        backend = RedisBackend.from_url(lock_url)
        task_id = str(uuid.uuid4())
        meta = {
            "task": name,
            "scope": "execution",
            "hostname": "celery@bench",
            "pid": str(os.getpid()),
            "since": f"{time.time():.3f}",
            "task_id": task_id,
        }
        assert backend.acquire(key, execution_token(task_id, 0), 600.0, meta=meta).acquired
        backend.close()
    client.set(f"only-one:noop:{HELD}", uuid.uuid4().hex, px=600_000)
    client.set(cookbook.lock_id("bench.cookbook.noop", HELD), "other", ex=600)
    client.close()


def child(argv: list[str]) -> int:
    """Under callgrind: warm up, then the loops of ``N`` and ``2N`` runs, each between two
    calls of ``os.getloadavg()`` (callgrind dumps before each)."""
    variant, mode, runs, warmup, lock_url = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    # A worker's default log level: a WARNING line is written (to stderr, here /dev/null).
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    app = _app(lock_url, [variant])
    run = _runner(app, variant, mode)
    check_outcome(variant, mode, run())
    for _ in range(warmup):
        run()
    # Each loop starts from the same state of Python's cyclic collector, so that its
    # collections, counted with the runs that trigger them, grow with the loop's length: without
    # this, a collection of an older generation falling in one loop and not the other (as any
    # change to the code imported moves them) shifts a figure by up to some 20k. What the
    # warm-up left alive (the app, its modules) is frozen: a worker's long-lived objects, which
    # its collector seldom walks.
    gc.collect()
    gc.freeze()
    os.getloadavg()
    for _ in range(runs):
        run()
    gc.collect()
    os.getloadavg()
    for _ in range(2 * runs):
        run()
    gc.collect()
    os.getloadavg()
    return 0


def client_costs(lock_url: str, work: Path, runs: int, warmup: int) -> dict[str, Any]:
    """Per run, for each variant and mode: instructions and system calls of the client."""
    out: dict[str, Any] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT),
           os.environ.get("PYTHONPATH"))))}  # fmt: skip
    for variant in VARIANTS:
        for mode in MODES:
            if variant == "plain" and mode == "refusal":
                continue  # nothing to refuse: its execution is the reference of both
            folder = work / f"client-{variant}-{mode}"
            folder.mkdir()
            command = [
                *_valgrind(folder / "cg.%p", f"--dump-before={MARKER}", "--collect-systime=yes"),
                sys.executable, "-m", "bench", "cost", "--child",
                variant, mode, str(runs), str(warmup), lock_url,
            ]  # fmt: skip
            started = time.monotonic()
            subprocess.run(command, cwd=ROOT, env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            dumps = sorted(folder.glob("cg.*.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
            # Dumps 1, 2, 3: before the first loop, after it (N runs), after the second (2N).
            one, two = _totals(dumps[1]), _totals(dumps[2])
            out[f"{variant}/{mode}"] = {
                "instructions": (two["Ir"] - one["Ir"]) / runs,
                "syscalls": (_syscalls(dumps[2]) - _syscalls(dumps[1])) / runs,
            }
            _log(f"client {variant}/{mode}: {out[f'{variant}/{mode}']} "
                 f"({time.monotonic() - started:.0f}s)")  # fmt: skip
    return out


class _CountedServer:
    """A redis-server under callgrind, dumped on demand."""

    def __init__(self, work: Path) -> None:
        from tests.servers import free_port

        self.folder = work / "server"
        self.folder.mkdir()
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        command = [
            *_valgrind(self.folder / "cg.%p"), "redis-server", "--port", str(self.port),
            "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--hz", "1",
            "--dir", str(self.folder),
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.dumps = 0
        import redis

        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("redis-server under callgrind did not start") from None
                time.sleep(0.2)
        client.close()

    def dump(self) -> int:
        """Instructions since the last dump, less what the server's cron took."""
        subprocess.run(
            ["callgrind_control", "-d", str(self.process.pid)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.dumps += 1
        path = self.folder / f"cg.{self.process.pid}.{self.dumps}"
        for _ in range(100):
            if path.exists() and "totals:" in path.read_text():
                break
            time.sleep(0.1)
        return _totals(path)["Ir"] - _inclusive(path, "serverCron")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def server_costs(work: Path, runs: int, warmup: int) -> dict[str, Any]:
    """Per run, for each variant and mode, and the references: the server's instructions."""
    import redis

    from singletask.protocol.tokens import execution_token

    server = _CountedServer(work)
    try:
        lock_url = f"{server.url}/1"
        app = _app(lock_url, [*VARIANTS, *SERVER_ONLY])
        hold_keys(app, lock_url)
        raw = redis.Redis.from_url(lock_url)
        raw.set("bench:once", "other", px=600_000)
        empty = raw.register_script("return 0")
        runners: dict[str, Callable[[], Any]] = {}
        for variant in (*VARIANTS, *SERVER_ONLY):
            for mode in MODES:
                if not (variant == "plain" and mode == "refusal"):
                    runners[f"{variant}/{mode}"] = _runner(app, variant, mode)
                    check_outcome(variant, mode, runners[f"{variant}/{mode}"]())

        def once() -> None:  # celery-once's refusal: SET NX PX refused, then PTTL
            raw.set("bench:once", "x", nx=True, px=3_600_000)
            raw.pttl("bench:once")

        runners["celery-once/refusal"] = once
        runners["EVALSHA return 0"] = lambda: empty(keys=["bench:empty"])
        # The floors of a script and of a lock record as singletask keeps it (a hash with an
        # expiry): the same no-op with the 8 arguments of an uncontended acquire; and the
        # fewest commands that take such a record (EXISTS, TIME, HSET of its 5 fields,
        # PEXPIRE) and owner-check and delete it (HGET, DEL), in two scripts.
        eight = ["t:0:h:1:n", "30000", "t:0:-:0:reserved", "1700000000123", "w", "h", "n", "11"]
        runners["EVALSHA return 0, 8 arguments"] = lambda: empty(keys=["bench:empty"], args=eight)
        script = raw.register_script

        def floor_key(n: int) -> str:
            return f"bench:floor:{n}"

        runners["floor: hash lock, two scripts"] = _take_and_give(
            script(_FLOOR_TAKE), script(_FLOOR_GIVE), eight, floor_key
        )
        # The same for a lock kept as one string (singletask's plain lock since issue 41): TIME
        # and SET NX PX of token, fence and packed metadata, then GET, compare and DEL.
        packed = ["t:0:h:1:n", "30000", "", "1700000000123", "w\0h\0n\x0011"]
        runners["floor: string lock, two scripts"] = _take_and_give(
            script(_FLOOR_TAKE_STRING), script(_FLOOR_GIVE_STRING), packed, floor_key
        )
        # And of a refusal by such a lock: a script given the acquire's 5 arguments that reads
        # the holder's value and its lease left (GET, PTTL) and returns them.
        refuse_string = raw.register_script(_FLOOR_REFUSE_STRING)
        raw.set("bench:floor-held", "other\0" + "1" * 16 + "\0\0w\0h", px=3_600_000)
        runners["floor: string refusal, one script"] = lambda: refuse_string(
            keys=["bench:floor-held"], args=packed
        )
        # The floors of the designs a one-script acquire with a server-made fencing token can
        # take, with an owner token and arguments shaped as singletask's own (an execution's
        # token; the acquire's 3 arguments: token, lease, the rest of the record) and two
        # keys: singletask's lock_args key (98 characters) and a one-lock-per-task key (32, as
        # ``singletask:`` and a short task name). Each design's execution takes a new key and
        # gives it back by the owner-checked release (GET, compare, DEL); its refusal meets a
        # key held by another owner. Run as scripts (EVALSHA) and, on Redis 7 and later, as
        # functions (FCALL). No design carries singletask's own checks (the lease's range, a
        # retried acquire by the holder, take-over, a kept hash record): these are floors.
        shaped_token = execution_token(str(uuid.uuid4()), 0)
        shaped_args = [shaped_token, "30000", "1700000000123\0n\x0011\0w\0bench"]
        keys = {
            "singletask's key": lambda n: f"bench:floor:{n:086x}",  # 12 + 86: 98 characters
            "one-per-task key": lambda n: f"singletask:bench.floor.{n:09x}",  # 32 characters
        }
        redis_7 = int(str(raw.info("server")["redis_version"]).split(".")[0]) >= 7
        designs = {name: body for name, body in DESIGNS.items() if redis_7 or name not in REDIS_7}
        engines = {"EVALSHA": _scripts(raw, designs)}
        if redis_7:
            engines["FCALL"] = _functions(raw, designs)
        for engine, calls in engines.items():
            for design in designs:
                for key_name, key_of in keys.items():
                    held = key_of(16**9 - 1)
                    raw.set(held, f"{uuid.uuid4()}:0:h:1:n\0{'1' * 16}\0\0w\0h", px=3_600_000)
                    name = f"design {design}, {key_name}, {engine}"
                    runners[f"{name}: execution"] = _take_and_give(
                        calls[design], calls["give"], shaped_args, key_of
                    )
                    runners[f"{name}: refusal"] = partial(
                        calls[design], keys=[held], args=shaped_args
                    )
        out: dict[str, Any] = {}
        for name, run in runners.items():
            for _ in range(warmup):
                run()
            server.dump()
            for _ in range(runs):
                run()
            one = server.dump()
            for _ in range(2 * runs):
                run()
            two = server.dump()
            out[name] = {"instructions": (two - one) / runs}
            _log(f"server {name}: {out[name]}")
        raw.close()
        return out
    finally:
        server.stop()


#: The floor of an acquire of singletask's lock record (see server_costs).
_FLOOR_TAKE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local now = redis.call('TIME')
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'f', now[1] .. now[2], 'a', '0', ARGV[5], ARGV[6],
  ARGV[7], ARGV[8])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

#: The floor of its owner-checked release.
_FLOOR_GIVE = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""

#: The floor of an acquire of a lock kept as one string (token NUL fence NUL since NUL fields).
_FLOOR_TAKE_STRING = """
local now = redis.call('TIME')
local fence = now[1] .. now[2]
if not redis.call('SET', KEYS[1], ARGV[1] .. '\\0' .. fence .. '\\0' .. ARGV[4] .. '\\0' .. ARGV[5],
  'NX', 'PX', ARGV[2]) then return 0 end
return fence
"""

#: The floor of a refusal by such a lock: the holder's value and lease left.
_FLOOR_REFUSE_STRING = """
local cur = redis.call('GET', KEYS[1])
return {0, cur, redis.call('PTTL', KEYS[1])}
"""

#: The floor of its owner-checked release.
_FLOOR_GIVE_STRING = """
local cur = redis.call('GET', KEYS[1])
if not cur or string.find(cur, ARGV[1], 1, true) ~= 1 then return 0 end
return redis.call('DEL', KEYS[1])
"""


#: The designs of a one-script acquire that issues a server-made fencing token (the server's
#: clock) in the step that takes the key, as Lua bodies run with KEYS[1] the lock key and ARGV
#: an owner token, a lease in ms and the rest of the record; each returns the fence when it
#: takes the key and the holder's record (and lease left) when it refuses. "reads first" is
#: singletask's order and reply; "no lease left" refuses with the holder alone (a refusal's
#: lease left would then have to come from the record and the client's clock); "writes first"
#: reads the clock and tries SET NX GET before it knows whether the key is free.
DESIGNS = {
    "reads first": """
local cur = redis.call('GET', KEYS[1])
if cur then return redis.call('PTTL', KEYS[1]) .. '\\0' .. cur end
local now = redis.call('TIME')
local fence = now[1] .. now[2]
redis.call('SET', KEYS[1], ARGV[1] .. '\\0' .. fence .. '\\0' .. ARGV[3], 'PX', ARGV[2])
return fence
""",
    "reads first, no lease left": """
local cur = redis.call('GET', KEYS[1])
if cur then return cur end
local now = redis.call('TIME')
local fence = now[1] .. now[2]
redis.call('SET', KEYS[1], ARGV[1] .. '\\0' .. fence .. '\\0' .. ARGV[3], 'PX', ARGV[2])
return fence
""",
    "writes first, no lease left": """
local now = redis.call('TIME')
local fence = now[1] .. now[2]
local cur = redis.call('SET', KEYS[1], ARGV[1] .. '\\0' .. fence .. '\\0' .. ARGV[3], 'NX', 'GET',
  'PX', ARGV[2])
if cur then return cur end
return fence
""",
}

#: The designs that need Redis 7 or later (``SET`` with both ``NX`` and ``GET``).
REDIS_7 = frozenset({"writes first, no lease left"})

#: A script or function of the floors, called as ``call(keys=[...], args=[...])``.
_Call = Callable[..., Any]


def _scripts(raw: Any, bodies: dict[str, str]) -> dict[str, _Call]:
    """Each body, and the owner-checked release as ``give``, as a script run by EVALSHA."""
    bodies = {**bodies, "give": _FLOOR_GIVE_STRING}
    return {name: raw.register_script(body) for name, body in bodies.items()}


def _functions(raw: Any, bodies: dict[str, str]) -> dict[str, _Call]:
    """The same as functions of one library (Redis 7 and later), run by FCALL."""
    names = {name: f"f{index}" for index, name in enumerate([*bodies, "give"])}
    library = "#!lua name=benchfloor\n" + "".join(
        f"redis.register_function('{names[name]}', function(KEYS, ARGV)\n{body}\nend)\n"
        for name, body in [*bodies.items(), ("give", _FLOOR_GIVE_STRING)]
    )
    raw.execute_command("FUNCTION", "LOAD", "REPLACE", library)

    def call(function: str, keys: list[str], args: list[str]) -> Any:
        return raw.execute_command("FCALL", function, len(keys), *keys, *args)

    return {name: partial(call, function) for name, function in names.items()}


def _take_and_give(
    take: _Call, give: _Call, args: list[str], key_of: Callable[[int], str]
) -> Callable[[], None]:
    """A run taking a new key (``key_of`` a counter) with ``take`` and owner-check-deleting it
    with ``give`` (given the owner token, ``args[0]``)."""
    count = iter(range(10**9))

    def run() -> None:
        key = key_of(next(count))
        take(keys=[key], args=args)
        give(keys=[key], args=args[:1])

    return run


# -- the report ---------------------------------------------------------------------------------


def figures(client: dict[str, Any], server: dict[str, Any]) -> dict[str, Any]:
    """Each variant's figures minus the plain task's, per execution and per refusal."""
    base_client = client["plain/execution"]
    base_server = server["plain/execution"]["instructions"]
    rows: dict[str, Any] = {}
    for variant in VARIANTS[1:]:
        for mode in MODES:
            name = f"{variant}/{mode}"
            rows[name] = {
                "server_instructions": server[name]["instructions"] - base_server,
                "client_instructions": client[name]["instructions"] - base_client["instructions"],
                "client_syscalls": client[name]["syscalls"] - base_client["syscalls"],
            }
    for variant in SERVER_ONLY:
        for mode in MODES:
            name = f"{variant}/{mode}"
            rows[name] = {"server_instructions": server[name]["instructions"] - base_server}
    rows["celery-once/refusal"] = {
        "server_instructions": server["celery-once/refusal"]["instructions"]
    }
    for name in (
        "EVALSHA return 0",
        "EVALSHA return 0, 8 arguments",
        "floor: hash lock, two scripts",
        "floor: string lock, two scripts",
        "floor: string refusal, one script",
    ):
        rows[name] = {"server_instructions": server[name]["instructions"]}
    for name in server:
        if name.startswith("design "):
            rows[name] = {"server_instructions": server[name]["instructions"]}
    return rows


def targets(rows: dict[str, Any]) -> dict[str, bool]:
    """The targets of issue 41, each true when this run meets it."""

    def get(name: str, what: str) -> float:
        return float(rows[name][what])

    return {
        "server per execution <= 2x only-one": get("singletask/execution", "server_instructions")
        <= 2 * get("only-one/execution", "server_instructions"),
        "server per refusal <= 2x celery-once": get("singletask/refusal", "server_instructions")
        <= 2 * get("celery-once/refusal", "server_instructions"),
        "client per execution < cookbook": get("singletask/execution", "client_instructions")
        < get("cookbook/execution", "client_instructions"),
        "client per refusal <= only-one": get("singletask/refusal", "client_instructions")
        <= get("only-one/refusal", "client_instructions"),
        "syscalls per refusal <= only-one": get("singletask/refusal", "client_syscalls")
        <= get("only-one/refusal", "client_syscalls"),
    }


def design_verdicts(rows: dict[str, Any]) -> dict[str, dict[str, bool]]:
    """Whether each design's floor, in this run, is within issue 41's two server targets."""
    execution_cap = 2 * rows["only-one/execution"]["server_instructions"]
    refusal_cap = 2 * rows["celery-once/refusal"]["server_instructions"]
    return {
        name.removesuffix(": execution"): {
            "execution": rows[name]["server_instructions"] <= execution_cap,
            "refusal": rows[name.replace(": execution", ": refusal")]["server_instructions"]
            <= refusal_cap,
        }
        for name in rows
        if name.startswith("design ") and name.endswith(": execution")
    }


def rst_table(rows: dict[str, Any]) -> str:
    def k(value: float | None) -> str:
        return "" if value is None else f"{value / 1000:,.0f}k"

    lines = [
        ".. list-table::",
        "   :header-rows: 1",
        "",
        "   * - per run, minus a plain task",
        "     - Redis server instructions",
        "     - client instructions",
        "     - client system calls",
    ]
    for name, row in rows.items():
        syscalls = row.get("client_syscalls")
        lines += [
            f"   * - {name}",
            f"     - {k(row['server_instructions'])}",
            f"     - {k(row.get('client_instructions'))}",
            f"     - {'' if syscalls is None else f'{syscalls:+.0f}'}",
        ]
    return "\n".join(lines) + "\n"


def _log(message: str) -> None:
    print(f"[cost] {message}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m bench cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="short loops (a check that it runs)")
    parser.add_argument("--runs", type=int, help="N: the loops are N and 2N runs long")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for cost.json/.rst")
    args = parser.parse_args(argv)
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate", "redis-server"):
        if shutil.which(tool) is None:
            print(f"python -m bench cost needs {tool} on PATH", file=sys.stderr)
            return 2
    config = dict(CONFIGS["quick" if args.quick else "full"])
    if args.runs:
        config["runs"] = args.runs
    runs, warmup = config["runs"], config["warmup"]
    work = Path(tempfile.mkdtemp(prefix="singletask-cost-"))
    import celery
    import redis

    import singletask
    from tests.servers import RedisServer

    native = RedisServer("redis-server", work / "native")
    native.start()
    try:
        lock_url = f"{native.url}/1"
        hold_keys(_app(lock_url, list(VARIANTS)), lock_url)
        client = client_costs(lock_url, work, runs, warmup)
    finally:
        native.stop()
    server = server_costs(work, server_runs(runs), warmup)
    rows = figures(client, server)
    results = {
        "environment": {
            "date": time.strftime("%Y-%m-%d"),
            "singletask": singletask.__version__,
            "python": platform.python_version(),
            "celery": celery.__version__,
            "redis_py": redis.__version__,
            "redis_server": subprocess.run(
                ["redis-server", "--version"], capture_output=True, text=True, check=True
            )
            .stdout.split()[2]
            .removeprefix("v="),
            "valgrind": subprocess.run(
                ["valgrind", "--version"], capture_output=True, text=True, check=True
            ).stdout.strip(),
            "runs": runs,
            "server_runs": server_runs(runs),
            "warmup": warmup,
        },
        "raw": {"client": client, "server": server},
        "rows": rows,
        "targets": targets(rows),
        "designs": design_verdicts(rows),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cost.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "cost.rst").write_text(rst_table(rows))
    print(rst_table(rows))
    for target, met in results["targets"].items():
        print(f"{'met' if met else 'NOT met'}: {target}")
    for design, met in results["designs"].items():
        within = [mode for mode, ok in met.items() if ok] or ["neither"]
        print(f"floor of {design} within the server target of: {', '.join(within)}")
    shutil.rmtree(work, ignore_errors=True)
    return 0

"""What singletask keeps per Celery app and per process, built on first use.

For each app (in an attribute of the app object, so two apps never share anything): the app's
validated :class:`~singletask.conf.settings.Settings`, and, per process, the lock store client and
its
:class:`~singletask.lease.Renewer`, both made again in a forked child. The renewers' threads
end when the app is closed (``app.close()``, or leaving ``with app:``) or collected. For each
singleton task (on the task object): its :class:`~singletask.conf.options.LockOptions`, the task's
declared options completed by its app's settings. Nothing is kept in module globals, so no
app's configuration is pinned for another.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any

from ..backends import backend_class, backend_from_url
from ..exceptions import ConfigurationError
from ..lease import Renewer
from ..protocol.tokens import this_pid
from .limits import SPEC_CACHE_SECONDS, SPEC_CACHE_SIZE, LimitSpec, check_spec
from .options import LockOptions, TaskOptions
from .settings import Settings

if TYPE_CHECKING:
    from celery import Celery, Task

    from ..backends.base import LockBackend

__all__ = ["AppState", "app_state", "check_lease_options", "is_singleton", "lock_options"]

#: A main-process release for the same task id within this many seconds is a repeat (Celery
#: reports a hard time limit through two hooks and two signals).
REPEAT_WINDOW = 10.0

#: What the settings report as ``backend_url`` while a store is given by
#: :func:`~singletask.task.override_lock_backend`.
OVERRIDE_URL = "override://"


class AppState:
    """Per app and per process: the validated settings and the backend, built on first use."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._mutex = threading.Lock()
        self._settings: Settings | None = None
        self._backend: LockBackend | None = None
        self._renewer: Renewer | None = None
        self._pid: int | None = None
        self._released: dict[str, float] = {}
        # Set by override(). The last override's renewer is kept after it ends, so a suite
        # that installs the same store object for each test starts one renewer thread.
        self._override: LockBackend | None = None
        self._override_renewer: tuple[LockBackend, Renewer] | None = None
        # Every renewer made for the app: their threads end when the app is closed or
        # collected (see watch()). The list refers to neither the app nor this state.
        self._renewers: list[Renewer] = []
        # Set while a worker of the app runs in this process (or its parent, for a forked pool
        # process): its renewers' threads wait for the next lease instead of ending with the last.
        self._serving = False
        # What a callable singletask_limits answered, by name: (spec, when it is asked again).
        self._specs: dict[str, tuple[LimitSpec, float]] = {}

    def limit_spec(self, name: str, task: str) -> LimitSpec:
        """The spec of the named limit ``name`` (a name of ``singletask_limits``, or what its
        callable answers for it, kept for :data:`~singletask.conf.limits.SPEC_CACHE_SECONDS`
        in this process).

        Raises:
            ConfigurationError: No such limit, or the callable's answer is no limit (it raised,
                or returned None); the message names the task and the limit.
        """
        known = self.settings.limits
        where = f"task {task!r}: limit {name!r} (setting singletask_limits)"
        if not callable(known):
            spec = known.get(name)
            if spec is None:
                raise ConfigurationError(f"{where}: no such limit")
            return spec
        now = time.monotonic()
        cached = self._specs.get(name)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            answer = known(name)
        except Exception as exc:
            raise ConfigurationError(
                f"{where}: the callable raised {type(exc).__name__}: {exc}"
            ) from exc
        if answer is None:
            raise ConfigurationError(f"{where}: no such limit (the callable returned None)")
        spec = check_spec(answer, where)
        if len(self._specs) >= SPEC_CACHE_SIZE:
            self._specs = {n: c for n, c in self._specs.items() if c[1] > now}
            if len(self._specs) >= SPEC_CACHE_SIZE:
                self._specs.clear()
        self._specs[name] = (spec, now + SPEC_CACHE_SECONDS)
        return spec

    def watch(self) -> None:
        """Stop the renewers' threads when the app is closed or garbage-collected.

        Celery has no hook for either: ``app.close`` is wrapped on the app object (Celery's
        ``with app:`` calls it too), and a finalizer runs when the app is collected.
        """
        renewers = self._renewers
        weakref.finalize(self.app, stop_renewers, renewers).atexit = False
        close = self.app.close

        @functools.wraps(close)
        def closing() -> None:
            stop_renewers(renewers)
            close()

        self.app.__dict__["close"] = closing

    @property
    def settings(self) -> Settings:
        """The app's settings, read and validated on first use.

        Raises:
            ConfigurationError: A setting is invalid, or no backend URL can be found.
        """
        if self._settings is None:
            given = OVERRIDE_URL if self._override is not None else None
            self._settings = Settings.from_app(self.app, backend_url=given)
        return self._settings

    def override(self, backend: LockBackend | None) -> None:
        """Use ``backend`` in this process instead of the configured store (None: stop)."""
        with self._mutex:
            kept = self._override_renewer
            if backend is not None and (kept is None or kept[0] is not backend):
                renewer = Renewer(backend)
                self._keep_renewer(renewer, instead_of=None if kept is None else kept[1])
                self._override_renewer = (backend, renewer)
            self._override = backend
            self._settings = None  # read again: with an override, no backend URL is needed

    @property
    def backend(self) -> LockBackend:
        """This process's lock store client (a forked child makes its own)."""
        override = self._override
        if override is not None:
            return override
        pid = this_pid()  # no system call: kept up to date across fork()
        if self._backend is None or self._pid != pid:
            with self._mutex:
                if self._backend is None or self._pid != pid:
                    settings = self.settings
                    connect = partial(
                        backend_from_url, settings.backend_url, **settings.backend_options()
                    )
                    self._backend = connect()
                    # Under gevent/eventlet the renewer runs on an OS thread, with a backend
                    # of its own (not possible for a store in this process's memory).
                    previous = self._renewer  # a forked child's parent's
                    self._renewer = Renewer(
                        self._backend, connect=None if self._backend.in_process else connect
                    )
                    self._keep_renewer(self._renewer, instead_of=previous)
                    self._pid = pid
        return self._backend

    def _keep_renewer(self, renewer: Renewer, *, instead_of: Renewer | None) -> None:
        """Count ``renewer`` among the app's, instead of the one it replaces (whose thread
        still ends by itself once it has nothing to renew)."""
        if instead_of is not None and instead_of in self._renewers:
            self._renewers.remove(instead_of)
        renewer.linger = self._serving
        self._renewers.append(renewer)

    def serve_worker(self, serving: bool) -> None:
        """A worker of the app starts (True) or shuts down (False) in this process: while it
        runs, the renewers' threads wait ``singletask.lease.IDLE_EXIT`` seconds for the
        next lease (back-to-back executions share one); once it is down they end with the last
        lease, and those with nothing to renew end now."""
        with self._mutex:
            self._serving = serving
            renewers = list(self._renewers)
            for renewer in renewers:
                renewer.linger = serving
        if not serving:
            stop_renewers(renewers)

    @property
    def renewer(self) -> Renewer:
        """The renewer of this process's backend."""
        if self._override is not None:
            assert self._override_renewer is not None
            return self._override_renewer[1]
        self.backend  # noqa: B018 - (re)creates backend and renewer in a new process
        assert self._renewer is not None
        return self._renewer

    @property
    def store_limit(self) -> tuple[float, str, frozenset[str]] | None:
        """The longest lease of this app's lock store, the store's name and the ``supports_*``
        features it has, from its class (an override's, or the one the URL's scheme chooses);
        None while that is not known."""
        if self._override is not None:
            store = type(self._override)
            return store.max_lease, store.__name__, features(store)
        return store_limit(self.settings)

    def first_release(self, task_id: str) -> bool:
        """True the first time a main-process release for ``task_id`` is asked for lately."""
        now = time.monotonic()
        with self._mutex:
            for stale in [t for t, at in self._released.items() if now - at > REPEAT_WINDOW]:
                del self._released[stale]
            if task_id in self._released:
                return False
            self._released[task_id] = now
            return True


def stop_renewers(renewers: list[Renewer]) -> None:
    """End the threads of ``renewers`` that have nothing to renew (the others once they have
    nothing left); a renewer given a lease later starts a new thread."""
    for renewer in list(renewers):
        renewer.stop()


def features(store: type[LockBackend]) -> frozenset[str]:
    """The ``supports_*`` attributes of a store class that are true."""
    names = (
        "supports_limit", "supports_rate", "supports_debounce", "supports_replace",
        "supports_units",
    )  # fmt: skip
    return frozenset(name for name in names if getattr(store, name, False))


def store_limit(settings: Settings) -> tuple[float, str, frozenset[str]] | None:
    """The longest lease the lock store of ``settings`` accepts (the ``max_lease`` of the class
    its URL's scheme chooses), its scheme as ``"scheme://"`` and the ``supports_*`` features
    it has; None when the URL is missing, invalid or of a store that cannot be imported (each
    use of the store reports that)."""
    try:
        url = settings.backend_url
        store = backend_class(url)
    except (ConfigurationError, ImportError):  # a plug-in that cannot be imported, too
        return None
    return store.max_lease, f"{url.split('://', 1)[0].lower()}://", features(store)


def check_lease_options(app: Celery, name: str, declared: TaskOptions) -> None:
    """Refuse the lease options of task ``name`` that the lock store of ``app`` cannot keep.

    Called when a task is bound to its app (Celery has read the app's configuration by then)
    and when a worker starts. Settings that cannot be read, or a store URL that is missing or
    unusable, are left to the first use of the store, which reports them: nothing is checked.

    Raises:
        ConfigurationError: An option is longer than the store's ``max_lease``; the message
            names the task, the attribute and the store.
    """
    try:
        settings = Settings.from_app(app)
    except ConfigurationError:
        return
    limit = store_limit(settings)
    if limit is not None:
        declared.check_store(name, settings, *limit)
        _check_limits_together(name, declared, settings)


def _check_limits_together(name: str, declared: TaskOptions, settings: Settings) -> None:
    """Refuse the named limits of task ``name`` that its lock store cannot take together (a
    Redis Cluster: not in one hash slot), for the names known before any call (a dict
    ``singletask_limits``; templates and a callable setting are checked by the store, per
    take, before it sends anything)."""
    if declared.limits is None or callable(settings.limits):
        return
    keys = []
    for limit in declared.limits.limits:
        spec = settings.limits.get(limit.name)
        if spec is not None:
            keys += [units.key for units in spec.units(settings.key_prefix, limit.name, 1)]
    if keys:
        backend_class(settings.backend_url).check_units_keys(
            keys, f"task {name!r} attribute lock_limits"
        )


def app_state(app: Celery) -> AppState:
    """The :class:`AppState` of ``app`` (made on first use)."""
    state = app.__dict__.get("_singletask_state")
    if state is None:
        made = AppState(app)
        state = app.__dict__.setdefault("_singletask_state", made)
        if state is made:
            made.watch()
    assert isinstance(state, AppState)
    return state


def is_singleton(task: object) -> bool:
    """Whether ``task`` is a singleton task: its class declared
    :class:`~singletask.conf.options.TaskOptions`."""
    return isinstance(getattr(task, "_singletask_options", None), TaskOptions)


def lock_options(task: Task[Any, Any]) -> LockOptions:
    """The lock options in effect for the singleton task ``task``.

    A singleton task class carries its declared :class:`~singletask.conf.options.TaskOptions` as
    ``_singletask_options``; they are completed from the app's settings on first use and kept
    on the task object.

    Raises:
        ConfigurationError: The app's settings are invalid, or a lease option is longer than
            the lock store accepts.
        TypeError: ``task`` is not a singleton task.
    """
    options: LockOptions | None = task.__dict__.get("_singletask_lock_options")
    if options is None:
        declared = getattr(task, "_singletask_options", None)
        if not isinstance(declared, TaskOptions):
            raise TypeError(f"task {task.name!r} is not a singleton task")
        state = app_state(task.app)
        options = declared.resolve(task.name, state.settings)
        limit = state.store_limit
        if limit is not None:  # first use: the store may be known only now
            declared.check_store(task.name, state.settings, *limit)
        if task.name is not None:  # a task without a name yet may get one, and a key with it
            task.__dict__["_singletask_lock_options"] = options
    return options

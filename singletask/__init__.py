"""singletask: one execution of a Celery task (or of a task for the same arguments) at a time.

::

    from singletask import SingletonTask

    @app.task(base=SingletonTask, lock_args=("customer_id",), lock_policy="retry")
    def sync_customer(customer_id, full=False): ...
"""

from __future__ import annotations

from ._moved import install as _install_moved
from .exceptions import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    ConfigurationError,
    LockKeyError,
    LockLost,
    LockPreempted,
    RateLimited,
    SingletaskError,
    TaskLocked,
    UnknownBackendError,
    UnsupportedOperation,
)
from .execution import startup  # noqa: F401 - connects the worker start-up checks
from .lease import LockHandle
from .result import Skipped
from .task import SingletonTask

__version__ = "0.4.0.dev0"

_install_moved()  # the module paths before 0.4.0 keep importing, with a warning

__all__ = [
    "BackendError",
    "BackendTimeout",
    "BackendUnavailable",
    "ConfigurationError",
    "LockHandle",
    "LockKeyError",
    "LockLost",
    "LockPreempted",
    "RateLimited",
    "SingletaskError",
    "SingletonTask",
    "Skipped",
    "TaskLocked",
    "UnknownBackendError",
    "UnsupportedOperation",
    "__version__",
]

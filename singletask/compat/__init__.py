"""Come from celery-once, celery-singleton or celery-heimdall by changing one import, or none.

* :mod:`singletask.compat.once`: ``QueueOnce``, ``AlreadyQueued`` (celery-once 3.0.1);
* :mod:`singletask.compat.singleton`: ``Singleton``, ``clear_locks``, ``DuplicateTaskError``
  (celery-singleton 0.3.1);
* :mod:`singletask.compat.heimdall`: ``HeimdallTask``, ``AlreadyQueuedError``, ``RateLimit``
  (celery-heimdall 1.0.1).

:func:`install` makes the old import paths (``celery_once``, ``celery_singleton``,
``celery_heimdall`` and their submodules) these modules, for code a team cannot edit: it puts
entries in ``sys.modules``, so ``from celery_once import AlreadyQueued`` anywhere in the process
gives the very class ``singletask.compat.once`` defines. What each base keeps and changes is
on docs/migrating.rst.
"""

from __future__ import annotations

import importlib
import sys

from ..exceptions import ConfigurationError

__all__ = ["ALIASES", "install", "uninstall"]

#: Old module path -> the compat module it is after :func:`install`.
ALIASES: dict[str, str] = {
    "celery_once": "singletask.compat.once",
    "celery_once.tasks": "singletask.compat.once.tasks",
    "celery_once.helpers": "singletask.compat.once.helpers",
    "celery_once.backends": "singletask.compat.once.backends",
    "celery_once.backends.redis": "singletask.compat.once.backends.redis",
    "celery_once.backends.file": "singletask.compat.once.backends.file",
    "celery_singleton": "singletask.compat.singleton",
    "celery_singleton.singleton": "singletask.compat.singleton.singleton",
    "celery_singleton.exceptions": "singletask.compat.singleton.exceptions",
    "celery_singleton.config": "singletask.compat.singleton.config",
    "celery_singleton.util": "singletask.compat.singleton.util",
    "celery_singleton.backends": "singletask.compat.singleton.backends",
    "celery_singleton.backends.base": "singletask.compat.singleton.backends.base",
    "celery_singleton.backends.redis": "singletask.compat.singleton.backends.redis",
    "celery_heimdall": "singletask.compat.heimdall",
    "celery_heimdall.task": "singletask.compat.heimdall.task",
    "celery_heimdall.config": "singletask.compat.heimdall.config",
    "celery_heimdall.errors": "singletask.compat.heimdall.errors",
}


def install(*libraries: str) -> None:
    """Make the old libraries' module paths import singletask's compat modules.

    Args:
        libraries: Which to alias, among ``"celery_once"``, ``"celery_singleton"`` and
            ``"celery_heimdall"``; all three when none is given.

    Raises:
        ConfigurationError: An old library itself is imported already in this process (its
            classes would not be the compat layer's): call ``install()`` before anything
            imports it, for instance at the top of the Celery app module or ``settings.py``.
    """
    wanted = libraries or ("celery_once", "celery_singleton", "celery_heimdall")
    unknown = sorted(set(wanted) - {name.split(".")[0] for name in ALIASES})
    if unknown:
        raise ConfigurationError(f"singletask.compat.install: no compat layer for {unknown}")
    chosen = {old: new for old, new in ALIASES.items() if old.split(".")[0] in wanted}
    for old, new in chosen.items():
        present = sys.modules.get(old)
        if present is not None and present.__name__ != new:
            raise ConfigurationError(
                f"singletask.compat.install: {old} is imported already from "
                f"{getattr(present, '__file__', '?')}; install the alias before it is imported"
            )
    for old, new in chosen.items():
        sys.modules[old] = importlib.import_module(new)


def uninstall() -> None:
    """Remove the aliases :func:`install` made (for test suites)."""
    for old, new in ALIASES.items():
        present = sys.modules.get(old)
        if present is not None and present.__name__ == new:
            del sys.modules[old]

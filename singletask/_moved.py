"""Module paths that moved, which still import until 1.0 (with a ``DeprecationWarning``).

0.3.0 grouped the stores in one package per family (``backends/redis/``, ``backends/sql/``,
``backends/memcached/``); 0.4.0 laid the rest of the package out by what happens at send and at
execution (``send/``, ``execution/``), the formats and settings they share (``protocol/``,
``conf/``), what is told outside the process (``observe/``) and what operators use (``ops/``).
Importing an old path imports its new module and gives the old name the same objects, so
``isinstance`` checks and subclasses keep working too. Two old paths are packages now and are
not served here: ``singletask.cli`` (its ``main`` and ``singletask`` command are where they
were) and ``singletask.observe``, an internal module whose names are in
``singletask.observe.report``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "install"]

#: Old module path -> the module it is now.
MOVED: dict[str, str] = {
    "singletask.backends.postgres": "singletask.backends.sql.postgres",
    "singletask.backends.mysql": "singletask.backends.sql.mysql",
    "singletask.backends.sqlite": "singletask.backends.sql.sqlite",
    "singletask.backends.redis_deploy": "singletask.backends.redis.deploy",
    # 0.4.0
    "singletask.config": "singletask.conf.settings",
    "singletask.options": "singletask.conf.options",
    "singletask.runtime": "singletask.conf.runtime",
    "singletask.keys": "singletask.protocol.keys",
    "singletask.slots": "singletask.protocol.slots",
    "singletask.tokens": "singletask.protocol.tokens",
    "singletask.messages": "singletask.protocol.headers",
    "singletask.enqueue": "singletask.send.dedup",
    "singletask.debounce": "singletask.send.debounce",
    "singletask.sends": "singletask.send.records",
    "singletask.lifecycle": "singletask.execution.lifecycle",
    "singletask.acquire": "singletask.execution.acquire",
    "singletask.outcomes": "singletask.execution.outcomes",
    "singletask.recovery": "singletask.execution.recovery",
    "singletask.replace": "singletask.execution.replace",
    "singletask.startup": "singletask.execution.startup",
    "singletask.worker": "singletask.execution.bootstep",
    "singletask.dispatch": "singletask.observe.events",
    "singletask.spans": "singletask.observe.spans",
    "singletask.flower": "singletask.observe.flower",
    "singletask.holders": "singletask.backends.holders",
    "singletask.urls": "singletask.backends.urls",
    "singletask.inventory": "singletask.ops.inventory",
    "singletask.state": "singletask.ops.bookkeeping",
    "singletask.web": "singletask.ops.web",
    "singletask.web.app": "singletask.ops.web.app",
    "singletask.web.asgi": "singletask.ops.web.asgi",
    "singletask.web.mount": "singletask.ops.web.mount",
    "singletask.web.server": "singletask.ops.web.server",
    "singletask.web.state": "singletask.ops.web.bookkeeping",
    "singletask.exporter": "singletask.ops.exporter",
    "singletask.exporter.events": "singletask.ops.exporter.events",
    "singletask.exporter.service": "singletask.ops.exporter.service",
    "singletask.exporter.store": "singletask.ops.exporter.store",
    "singletask.cli_locks": "singletask.cli.locks",
    "singletask.cli_web": "singletask.cli.web",
    "singletask.cli_exporter": "singletask.cli.exporter",
    "singletask.cli_store": "singletask.cli.base",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module paths, and fills each with its new module's public names."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        # An old package (``singletask.web``) keeps its old submodules importable.
        package = any(old.startswith(fullname + ".") for old in MOVED)
        return importlib.util.spec_from_loader(fullname, self, is_package=package)

    def exec_module(self, module: ModuleType) -> None:
        new = MOVED[module.__name__]
        warnings.warn(
            f"{module.__name__} is now {new}; the old path will be removed in 1.0",
            DeprecationWarning,
            stacklevel=2,
        )
        target = importlib.import_module(new)
        names = getattr(target, "__all__", None) or [n for n in vars(target) if n[:1] != "_"]
        module.__dict__.update({name: getattr(target, name) for name in names})
        module.__all__ = list(names)  # type: ignore[attr-defined]


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())

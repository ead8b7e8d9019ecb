"""The stores' module paths before 0.3.0, which still import (with a ``DeprecationWarning``).

0.3.0 grouped the stores in one package per family (``backends/redis/``, ``backends/sql/``,
``backends/memcached/``). The modules whose store classes the documentation named keep working
under their old names: importing one imports its new module and gives the old name the same
objects, so ``isinstance`` checks and subclasses of the store classes keep working too.
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
        return importlib.util.spec_from_loader(fullname, self)

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

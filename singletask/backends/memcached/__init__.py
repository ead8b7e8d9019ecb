"""The memcached lock store (``memcached://``): :class:`MemcachedBackend`.

* ``store``: the store, every state change one ``add`` or one ``cas``;
* ``items``: the items it keeps and their names;
* ``fences``: the fencing-token counter.
"""

from __future__ import annotations

from .store import MemcachedBackend

__all__ = ["MemcachedBackend"]

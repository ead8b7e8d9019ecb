"""A TCP forwarder the test controls: how an e2e test takes a shared database "down".

The machine's PostgreSQL and MariaDB serve other tests and other people, so a test never stops
them. Workers reach the lock store through this proxy instead; ``stop()`` closes the listening
port and cuts every open connection (to the workers the server is gone: connection reset, then
refused), and ``start()`` listens on the same port again (the server is back).

``TcpProxy`` is the suite's fault proxy (:class:`tests.faultproxy.FaultProxy`, which can also
delay, stall and re-point); ``TcpProxy.for_url(url)`` returns a listening proxy and ``url``
rewritten to go through it (``start()`` on a listening proxy does nothing).
"""

from __future__ import annotations

from ..faultproxy import FaultProxy as TcpProxy

__all__ = ["TcpProxy"]

"""``singletask demo`` and the machinery it shares with the programs in ``examples/``.

* :mod:`~singletask.demo.local`: a Celery app on this machine, with embedded parts (filesystem
  broker, file results, SQLite locks) or servers.
* :mod:`~singletask.demo.worker`: a real prefork worker for it, as a subprocess.
* :mod:`~singletask.demo.example`: what the programs in ``examples/`` are built on.
* :mod:`~singletask.demo.events`: the event log worker processes append to.
* :mod:`~singletask.demo.app`, :mod:`~singletask.demo.tasks`: the demo's app and tasks.
* :mod:`~singletask.demo.scenarios`: what the demo sends, and when.
* :mod:`~singletask.demo.timeline`, :mod:`~singletask.demo.display`: what it draws.
* :mod:`~singletask.demo.runner`: the demo itself; :mod:`~singletask.demo.report`: its reports.

Nothing here is needed to use :class:`~singletask.SingletonTask`.
"""

"""``python -m singletask``: the ``singletask`` command line (see :mod:`singletask.cli`)."""

from __future__ import annotations

from .cli import singletask

if __name__ == "__main__":
    singletask.main(prog_name="python -m singletask")

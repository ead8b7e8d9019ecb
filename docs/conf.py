"""Sphinx configuration of the singletask documentation.

Build (warnings are errors, no network needed)::

    sphinx-build -W -b html docs docs/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import singletask  # noqa: E402 - needs the project root on sys.path first

project = "singletask"
author = "singletask developers"
copyright = "2026, singletask developers"
release = singletask.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]
# No intersphinx: the build must work offline. Celery, redis-py and Python are linked with
# plain URLs in the text instead, so the nitpicky build (`-n`, a step of .ci/run) leaves the
# names of other projects, which only intersphinx could resolve, unlinked without a warning.
# A name of singletask that does not resolve is still a warning.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(abc|collections\.abc|typing|pathlib|datetime|ssl|os|random)(\..*)?"),
    (r"py:.*", r"(types|inspect)(\..*)?"),
    (r"py:.*", r"(celery|kombu|redis|django|pymysql|psycopg|pymemcache|click|billiard)(\..*)?"),
    # Celery's classes as their annotations name them, and type variables.
    (r"py:class", r"(Task|Celery|AsyncResult|Signal|T)"),
]
# Internal names that the package's docstrings mention, which autodoc renders on the API and
# architecture pages but no page documents (internal modules, private helpers, names relative
# to a module autodoc did not document). Each one renders as code without a link. The list is
# exact, so that any other name of singletask that does not resolve is still a warning; when a
# docstring stops naming one, take it out.
nitpick_ignore = (
    [
        ("py:class", name)
        for name in (
            "singletask.conf.settings.Settings",
            "singletask.protocol.keys.KeySpec",
            "singletask.backends.sql.core.SQLBackend",
            "singletask.backends.redis.deploy._Deployed",
            "TaskOptions",
            "singletask.conf.limits.TaskLimits",
            "singletask.conf.limits.LimitSpec",
            "singletask.backends.sql.postgres.units.PostgresUnits",
            "singletask.backends.sql.mysql.units.MySQLUnits",
            "singletask.backends.turns.Line",
        )
    ]
    + [
        ("py:mod", name)
        for name in (
            "singletask.task",
            "singletask.conf.settings",
            "singletask.protocol.slots",
            "singletask.execution.replace",
            "singletask.execution.recovery",
            "singletask.backends.redis.rates",
            "singletask.backends.redis.slots",
            "singletask.demo.events",
            "singletask.demo.runner",
            "singletask.backends.redis.units",
            "singletask.execution.units",
        )
    ]
    + [
        ("py:attr", "AcquireResult.key"),
        ("py:attr", "AcquireResult.holders"),
        ("py:attr", "AcquireResult.completed"),
        ("py:attr", "LockRecord.slot"),
        ("py:attr", "store_key"),
        ("py:meth", "LockBackend.iter_locks"),
        ("py:meth", "LockBackend.holder"),
        ("py:data", "singletask.backends.redis.store.FENCE_RETENTION"),
        ("py:data", "singletask.backends.redis.store.MARKER_RETENTION"),
        ("py:data", "singletask.conf.settings.POLICIES"),
        ("py:data", "POLICIES"),
        ("py:data", "LEASE_OPTIONS"),
        ("py:data", "IDLE_EXIT"),
        ("py:exc", "DemoError"),
        ("py:class", "Setup"),
        ("py:func", "configure"),
        ("py:func", "published_as_is"),
        ("py:func", "singletask.execution.replace.preempt"),
        ("py:func", "together"),
        ("py:func", "claim_follow_up"),
        ("py:func", "enter_window"),
        ("py:func", "reserve"),
        ("py:func", "singletask.execution.units.own_key"),
        ("py:func", "singletask.protocol.limits.limit_key"),
        ("py:meth", "singletask.ops.limits.LimitRecord.from_store"),
        ("py:data", "MAX_SHOWN"),
        ("py:data", "MAX_UNITS"),
        ("py:data", "HOLD_FIELDS"),
        ("py:data", "LIMIT_FIELDS"),
        ("py:data", "singletask.conf.limits.SPEC_CACHE_SECONDS"),
        ("py:attr", "holds"),
    ]
)

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
templates_path: list[str] = []

# -- autodoc / napoleon --------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True

# -- MyST (the changelog page includes ../CHANGELOG.md) -----------------------------------
myst_heading_anchors = 2

# -- HTML ----------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"singletask {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]

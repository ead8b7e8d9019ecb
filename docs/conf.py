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
# plain URLs in the text instead.

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

"""singletask's benchmarks: ``python -m bench SUITE [options]`` (``python -m bench`` lists them).

``harness/`` holds what every suite shares (the private servers, the Celery app of the
contenders, the store runs), ``suites/`` what is measured, ``alternatives/`` the recipes
singletask is compared with, ``report/`` the tables, the docs page's tables and the plot.
"""

from __future__ import annotations

from pathlib import Path

#: The repository's root: on ``sys.path`` of the benchmark and of the workers it starts.
ROOT = Path(__file__).resolve().parents[1]

#: The default output folder of every suite (git ignores it).
RESULTS = ROOT / "bench" / "results"

"""The Celery cookbook's feed importer: one import per feed URL at a time, on every worker.

    python examples/feed_importer.py                  # nothing to install or start
    python examples/feed_importer.py --redis-url redis://localhost:6379/0

The cookbook's recipe ("Ensuring a task is only executed one at a time") keeps a lock per feed
URL in a cache, and a duplicate logs that the feed "is already being imported by another worker"
and returns. Here the lock is singletask's, with a readable key per URL; a duplicate returns a
Skipped that names the import holding the lock.
"""

from __future__ import annotations

import time

from celery import Celery

from singletask import SingletonTask, Skipped
from singletask.demo.example import configure, run_example

app = Celery("feed_importer")
configure(app)  # broker, results and locks: the embedded ones, or the --redis-url database

NEWS, BLOG = "https://example.org/news.rss", "https://example.org/blog.rss"


@app.task(base=SingletonTask, lock_key="feed:{feed_url}")
def import_feed(feed_url: str) -> str:
    time.sleep(2)  # stand-in for fetching the feed and storing its entries
    return f"imported {feed_url}"


def main() -> None:
    print(f"lock key of {NEWS}: {import_feed.lock_key_for((NEWS,))}\n")
    calls = [(url, import_feed.delay(url)) for url in (NEWS, BLOG, NEWS)]
    for url, result in calls:
        value = result.get(timeout=30)
        if isinstance(value, Skipped):
            value = f"skipped, already being imported by task {value.holder}"
        print(f"import_feed({url!r}) [{result.id[:8]}]: {value}")


if __name__ == "__main__":
    run_example(__file__, app, main)

"""kombu's filesystem transport, with messages that appear in the folder whole.

kombu's filesystem transport (``filesystem://``, kombu 5.3 to 5.7 at least) creates a message's
file and then writes into it. A consumer that lists the folder in between moves and reads an
empty file, and the worker's consumer dies with ``JSONDecodeError: Expecting value: line 1
column 1`` (reported upstream as celery/kombu#1551). The demo hits that window when a task that
retries publishes while the worker polls. This transport writes each message under a temporary
name that consumers skip, then renames it into place: a rename is atomic on a POSIX file system,
so a consumer sees a message whole or not at all. Everything else is kombu's.

Selected with the Celery setting ``broker_transport`` (the broker URL stays ``filesystem://``).
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps

__all__ = ["Channel", "Transport"]


class Channel(filesystem.Channel):
    """A filesystem channel whose ``_put`` renames a complete file into the queue folder."""

    # kombu-stubs types this method differently in the base and the filesystem channel.
    def _put(self, queue: str, payload: dict[str, Any], **kwargs: Any) -> None:  # type: ignore[override]
        stamp = f"{round(monotonic() * 1000)}_{uuid.uuid4()}"
        folder = self.data_folder_out
        # A name that starts with a dot does not end in ".<queue>.msg" after its first dot,
        # so kombu's _get, _size and _purge all skip it until it is renamed.
        temporary = os.path.join(folder, f".{stamp}.part")
        final = os.path.join(folder, f"{stamp}.{queue}.msg")
        try:
            with open(temporary, "wb") as file:
                file.write(dumps(payload).encode())
            os.replace(temporary, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    """kombu's filesystem transport with :class:`Channel`."""

    Channel = Channel

"""A child process that ends with its parent: the engine core (its parent, the HTTP server),
tensor-parallel ranks (their core) and `--api-servers`' extra HTTP processes (the server that
started them). `kill -9` of a parent kills no child by itself; this does, within
`PARENT_POLL_S`."""

from __future__ import annotations

import os
import threading
import time

PARENT_POLL_S = 0.2


def watch_parent(parent_pid: int) -> None:
    """Exit this process at once when `parent_pid` is no longer its parent (it died)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()

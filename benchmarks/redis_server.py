"""A throwaway redis-server for a benchmark: on a free port, in a temporary folder, no
persistence; stopped on exit. `redis-server` comes from PATH (Debian's `redis-server`
package; on the offline GPU machine, unpacked from its .deb)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time


class RedisServer:
    def __enter__(self) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.dir = tempfile.TemporaryDirectory()
        self.proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", self.dir.name], stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT)
        self.url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while True:  # up once it accepts a connection
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.dir.cleanup()

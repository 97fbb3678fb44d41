"""`switchboard router --redis-url URL --port P`: the front of several replicas."""

from __future__ import annotations

import argparse
import logging
import signal
import time

from gateway.registry import HEARTBEAT_S

MAX_BODY_BYTES = 2**28 + 2**20  # the replicas' default adapter upload limit, plus the form


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="route OpenAI requests over replicas sharing one Redis")
    p.add_argument("--redis-url", metavar="URL", required=True,
                   help="the Redis the replicas were started with (--redis-url)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port, 0 for any free (default 8080)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="largest request body forwarded (default: 257 MiB, for adapter uploads)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    from gateway.router.app import create_router_app
    from gateway.server import ServerThread

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = create_router_app(args.redis_url, args.max_body_bytes)
    server = ServerThread(app, args.host, args.port, args.log_level)
    try:
        server.start()
    except RuntimeError as e:
        print(f"error: {e} (port {args.port} in use?)")
        return 1
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        time.sleep(HEARTBEAT_S)  # the first view of the replicas
        n = len(app.state.pool.candidates())
        print(f"Switchboard router at {server.url} (OpenAI base URL: {server.url}/v1), "
              f"{n} replicas", flush=True)
        while server.alive():
            server.thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt

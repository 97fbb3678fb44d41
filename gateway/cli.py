"""`switchboard serve`: flags and/or a TOML file -> one `ServeConfig` -> the HTTP server.

The server listens at once (/health answers, /ready says 503) while the model loads behind a
progress bar; then it prints the URL and a ready-to-paste curl line.

SIGTERM drains: new API requests get 503 (and /ready says 503) while the running ones finish,
for at most `--drain-timeout` seconds; then the process exits 0. Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import UnionType
from typing import Any, Literal, NamedTuple, get_args, get_origin

from pydantic.fields import FieldInfo

from engine.config import EngineConfig
from gateway.config import ConfigError, ServeConfig, build_config

FLAG_TYPES = (bool, int, float, str, Path)  # a field of another type (a table) is TOML-only


class Flag(NamedTuple):
    """A `ServeConfig` field that is a flag: `--<key>`, where the key is the field's alias if it
    has one (`num_pages` is `--kv-pages`), else its name."""

    name: str
    key: str
    info: FieldInfo
    kind: Any  # the value's type, None stripped


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """`serve` with one flag per scalar `ServeConfig` field (see `engine.config.setting`)."""
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--config", metavar="TOML", help="TOML file with any of these settings")
    p.add_argument("--api-keys", metavar="FILE",
                   help="JSON file mapping API keys to tenants (default: auth off)")
    engine, server = p.add_argument_group("engine"), p.add_argument_group("server")
    for flag in serve_flags():
        group = engine if flag.name in EngineConfig.model_fields else server
        group.add_argument("--" + flag.key.replace("_", "-"), dest=flag.key, default=None,
                           help=_help(flag.info), **_parse_as(flag))
    p.set_defaults(func=serve)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The flags given (the others are None) override the TOML file's settings."""
    overrides = {flag.key: getattr(args, flag.key) for flag in serve_flags()}
    return build_config(args.config, api_keys=args.api_keys, **overrides)


def serve_flags() -> Iterator[Flag]:
    """The flags, engine settings first, in declaration order."""
    for name, info in ServeConfig.model_fields.items():
        kind = info.annotation
        if isinstance(kind, UnionType):  # `X | None`: the flag parses an X
            kind = next(t for t in get_args(kind) if t is not type(None))
        if kind in FLAG_TYPES or get_origin(kind) is Literal:
            yield Flag(name, info.alias or name, info, kind)


def _parse_as(flag: Flag) -> dict[str, Any]:
    """argparse's arguments for the flag's value: on/off for a bool (neither given, an "auto"
    setting stays auto), choices for a Literal."""
    if flag.kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(flag.kind) is Literal:
        return {"choices": get_args(flag.kind)}
    extra = flag.info.json_schema_extra
    metavar = extra.get("metavar", "N") if isinstance(extra, dict) else "N"
    return {"type": flag.kind, "metavar": metavar}


def _help(info: FieldInfo) -> str:
    """The field's help text and, unless the text speaks of it, its default."""
    text = info.description or ""
    if info.default_factory is not None or info.default is None or "default" in text:
        return text
    return f"{text} (default: {info.default})"


def serve(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gateway.api_servers import APIServers
    from gateway.app import create_app
    from gateway.runtime import FLUSH_S
    from gateway.server import ServerThread

    console = Console(stderr=True)
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        _error(console, str(e))
        return 2
    app = create_app(cfg)
    server = ServerThread(app, cfg.host, cfg.port, cfg.log_level,
                          app.state.runtime.connections, reuse_port=cfg.api_servers > 1)
    try:
        server.start()
    except RuntimeError as e:
        _error(console, f"{e} (port {cfg.port} in use?)")
        return 1
    signal.signal(signal.SIGTERM, _interrupt)  # while loading, SIGTERM stops as Ctrl-C does
    others: APIServers | None = None
    term = threading.Event()
    try:
        runtime = app.state.runtime
        if runtime.cluster:
            runtime.cluster.advertise(server.url)
        _show_loading(console, runtime)
        if runtime.load_error is not None:
            _error(console, str(runtime.load_error))
            return 1
        if cfg.api_servers > 1:
            engine = runtime.engine
            others = APIServers(cfg, server.port, engine.link.address, engine.link.authkey)
            why = others.wait_ready()
            if why is not None:
                _error(console, why)
                return 1
        signal.signal(signal.SIGTERM, lambda *_: term.set())  # from now on, SIGTERM drains
        _print_banner(cfg, server.url)
        while server.alive() and not term.wait(0.5):
            pass
        if term.is_set():
            console.print(f"SIGTERM: draining (at most {cfg.drain_timeout:g} s)", highlight=False)
            if others is not None:
                others.drain()
            if not runtime.drain(cfg.drain_timeout):
                _error(console, "drain deadline passed; the unfinished requests were failed")
    except KeyboardInterrupt:
        pass
    finally:
        if others is not None:
            others.stop(cfg.drain_timeout + FLUSH_S if term.is_set() else 0.0)
        server.stop()
    return 0


def _error(console, message: str) -> None:  # noqa: ANN001 - a rich Console
    from rich.markup import escape

    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _show_loading(console, runtime) -> None:  # noqa: ANN001 - rich / Runtime, imported late
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from gateway.runtime import STAGES

    columns = (SpinnerColumn(), TextColumn("{task.description:<20}"), BarColumn(),
               TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(STAGES[0], total=len(STAGES) - 1)
        while not runtime.loaded.wait(0.1):
            stage = runtime.stage
            progress.update(task, description=stage, completed=STAGES.index(stage))
        if runtime.load_error is None:
            progress.update(task, description="ready", completed=len(STAGES) - 1)


def _print_banner(cfg: ServeConfig, url: str) -> None:
    body = {"model": cfg.model_name, "messages": [{"role": "user", "content": "Say hello!"}],
            "max_tokens": 32}
    auth = ' -H "Authorization: Bearer YOUR_API_KEY"' if cfg.api_keys else ""
    print(f"Switchboard is serving {cfg.model_name} at {url}  (OpenAI base URL: {url}/v1)")
    print("Try it:")
    print(f"curl {url}/v1/chat/completions -H \"Content-Type: application/json\"{auth} "
          f"-d '{json.dumps(body)}'", flush=True)


if __name__ == "__main__":  # `python -m gateway.cli` == `switchboard serve`
    parser = argparse.ArgumentParser(prog="switchboard")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["serve", *sys.argv[1:]])
    sys.exit(ns.func(ns))

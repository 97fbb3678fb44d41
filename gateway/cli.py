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

from gateway.config import ConfigError, ServeConfig, build_config

# (flag, metavar, type, help); each flag's dest is a ServeConfig field.
FLAGS: list[tuple[str, str, type, str]] = [
    ("--model", "PATH", str, "HF checkpoint folder or .gguf file (default: embedded SmolLM2)"),
    ("--served-model-name", "NAME", str, "the `model` clients send (default: from --model)"),
    ("--host", "HOST", str, "interface to bind (default 127.0.0.1)"),
    ("--port", "PORT", int, "port to bind, 0 for any free port (default 8000)"),
    ("--api-keys", "FILE", str, "JSON file mapping API keys to tenants (default: auth off)"),
    ("--max-num-seqs", "N", int, "most sequences in the running batch"),
    ("--max-num-batched-tokens", "N", int, "token budget per engine step"),
    ("--kv-pages", "N", int, "KV cache pages (default: sized from --kv-cache-gb)"),
    ("--page-size", "N", int, "tokens per KV page"),
    ("--kv-cache-gb", "GB", float, "KV cache budget when --kv-pages is not given"),
    ("--max-model-len", "N", int, "context length cap"),
    ("--dtype", "DTYPE", str, "float32 | bfloat16 | float16"),
    ("--device", "DEVICE", str, "cpu | cuda"),
    ("--seed", "N", int, "engine seed for unseeded sampling"),
    ("--threads", "N", int, "torch CPU threads (default: torch's choice, one per core)"),
    ("--max-loras", "N", int, "LoRA adapters resident in device slots (0: base model only)"),
    ("--max-cpu-loras", "N", int, "LoRA adapters cached in host memory (>= --max-loras)"),
    ("--max-lora-rank", "R", int, "largest adapter rank served (the slot width)"),
    ("--adapter-dir", "DIR", str, "where uploaded adapters are stored (default: cache dir)"),
    ("--max-adapter-bytes", "N", int, "largest accepted adapter upload"),
    ("--max-adapters-per-tenant", "N", int, "adapters a tenant may store (default 100; the "
     "keys file's max_adapters overrides it per tenant)"),
    ("--max-adapter-storage-per-tenant", "BYTES", int, "bytes of adapter files a tenant may "
     "store (default 8 GiB; max_adapter_storage_bytes in the keys file overrides it)"),
    ("--redis-url", "URL", str, "shared state for replicas (sessions, keys, limits, adapters), "
     "e.g. redis://host:6379/0 (default: in-process)"),
    ("--advertise-url", "URL", str, "how routers reach this replica, e.g. http://10.0.0.7:8000 "
     "(default: http://HOST:PORT)"),
    ("--session-kv-pages", "N", int, "KV pages a tenant's sessions keep pinned between turns"),
    ("--max-queue", "N", int, "sequences that may wait beyond a full batch before 429s"),
    ("--max-request-bytes", "N", int, "largest accepted request body"),
    ("--default-max-tokens", "N", int, "max_tokens when a request leaves it out (default "
     "4096, capped by what is left of the context)"),
    ("--drain-timeout", "SECONDS", float, "on SIGTERM, how long running requests may finish"),
    ("--log-level", "LEVEL", str, "critical | error | warning | info | debug"),
]


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--config", metavar="TOML", help="TOML file with any of these settings")
    for flag, metavar, type_, help_ in FLAGS:
        p.add_argument(flag, metavar=metavar, type=type_, default=None, help=help_)
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=None,
                   help="never reuse cached KV across requests (sessions then re-prefill)")
    p.add_argument("--public-metrics", dest="public_metrics", action="store_true", default=None,
                   help="serve /metrics without a key (default with --api-keys: admin keys only)")
    p.set_defaults(func=serve)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    overrides = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
                 for flag, *_ in FLAGS}
    overrides["prefix_cache"] = getattr(args, "prefix_cache", None)
    overrides["public_metrics"] = getattr(args, "public_metrics", None)
    return build_config(args.config, **overrides)


def serve(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gateway.app import create_app
    from gateway.server import ServerThread

    console = Console(stderr=True)
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        _error(console, str(e))
        return 2
    app = create_app(cfg)
    server = ServerThread(app, cfg.host, cfg.port, cfg.log_level)
    try:
        server.start()
    except RuntimeError as e:
        _error(console, f"{e} (port {cfg.port} in use?)")
        return 1
    signal.signal(signal.SIGTERM, _interrupt)  # while loading, SIGTERM stops as Ctrl-C does
    try:
        runtime = app.state.runtime
        if runtime.cluster:
            runtime.cluster.advertise(server.url)
        _show_loading(console, runtime)
        if runtime.load_error is not None:
            _error(console, str(runtime.load_error))
            return 1
        term = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: term.set())  # from now on, SIGTERM drains
        _print_banner(cfg, server.url)
        while server.alive() and not term.wait(0.5):
            pass
        if term.is_set():
            console.print(f"SIGTERM: draining (at most {cfg.drain_timeout:g} s)", highlight=False)
            if not runtime.drain(cfg.drain_timeout):
                _error(console, "drain deadline passed; the unfinished requests were failed")
    except KeyboardInterrupt:
        pass
    finally:
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

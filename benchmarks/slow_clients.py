"""Slow clients: N connections that trickle their request headers (one byte every few seconds)
or send nothing at all, against `switchboard serve`, while a probe times `/health` on a fresh
connection every 0.2 s, as a liveness probe would. Each round (every few seconds) the attack
sends a byte on each trickling connection and opens again those the server closed (as
slowloris does), so it keeps N connections coming for its whole duration.

The attack runs in worker processes (each raises its own open-file limit; N/workers sockets
each, on epoll), at the lowest CPU priority: on a machine it shares with the server it takes
only the CPU the server leaves (a real attacker's CPU is elsewhere). The probe and the
/metrics reader run in this process. Reports /health latency before, during and after the
attack, and what the server did to the connections.

    .venv/bin/python benchmarks/slow_clients.py [--connections 20000] [--duration 60]
        [--url URL] [--out benchmarks/results/slow_clients_cpu.md]
"""

from __future__ import annotations

import argparse
import errno
import multiprocessing as mp
import os
import re
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parents[1]
HEADERS = b"GET /v1/models HTTP/1.1\r\nHost: victim\r\n"  # then "X-a: b\r\n" forever
FILLER = b"X-a: b\r\n"
STATS = ("opened", "answered_503", "answered_408", "closed_silently", "connect_errors")
PROBE_S = 0.2
PROBE_TIMEOUT_S = 10.0
NICE = 19  # the attack shares this machine's cores: it gets what the server leaves


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# -- the attackers (worker processes) ------------------------------------------------------


def attack(addr: tuple[str, int], n: int, silent_every: int, interval: float, stop_at: float,
           stats: mp.Array) -> None:  # type: ignore[valid-type]
    """Hold `n` connections until `stop_at` (time.time()): every `silent_every`-th sends
    nothing, the others one more byte of never-ending headers every `interval` s."""
    raise_fd_limit()
    os.nice(NICE)
    sel = selectors.DefaultSelector()
    sent: dict[socket.socket, int] = {}  # bytes of headers sent; -1: a silent connection
    made = 0

    def count(name: str) -> None:
        with stats.get_lock():
            stats[STATS.index(name)] += 1

    def open_one() -> None:
        nonlocal made
        s = socket.socket()
        s.setblocking(False)
        if s.connect_ex(addr) not in (0, errno.EINPROGRESS):
            s.close()
            count("connect_errors")
            time.sleep(0.01)
            return
        sel.register(s, selectors.EVENT_READ)
        sent[s] = -1 if made % silent_every == 0 else 0
        made += 1
        count("opened")

    def close(s: socket.socket) -> None:
        sel.unregister(s)
        s.close()
        del sent[s]

    tick = time.monotonic()
    missing = n  # to open at the next round (a batch at a time while ramping up)
    while time.time() < stop_at:
        for _ in range(min(256, missing)):
            open_one()
            missing -= 1
        for key, _ in sel.select(timeout=0.02):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                answer = s.recv(4096)
            except OSError:
                answer = b""
            count("answered_503" if answer.startswith(b"HTTP/1.1 503") else
                  "answered_408" if answer.startswith(b"HTTP/1.1 408") else "closed_silently")
            close(s)  # the server closes after any answer
        if time.monotonic() >= tick:  # a round: a byte on each, and reopen what was closed
            tick += interval
            missing = n - len(sent)
            for s, k in list(sent.items()):
                if k < 0:
                    continue
                stream = HEADERS if k < len(HEADERS) else FILLER
                i = k if k < len(HEADERS) else (k - len(HEADERS)) % len(FILLER)
                try:
                    s.send(stream[i:i + 1])
                    sent[s] = k + 1
                except BlockingIOError:
                    pass  # still connecting
                except OSError:
                    count("closed_silently")
                    close(s)
    for s in list(sent):
        close(s)


# -- the probe and the server's view (this process) -----------------------------------------


@dataclass
class Probes:
    at: list[float] = field(default_factory=list)  # time.time() each probe started
    took: list[float | None] = field(default_factory=list)  # seconds; None: failed


def probe(addr: tuple[str, int], out: Probes, stop: threading.Event) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n"
    while not stop.is_set():
        t, took = time.time(), None
        try:
            with socket.create_connection(addr, timeout=PROBE_TIMEOUT_S) as s:
                s.sendall(request)
                data = b""
                while b'"status":"ok"' not in data and (chunk := s.recv(4096)):
                    data += chunk
                if data.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in data:
                    took = time.time() - t
        except OSError:
            pass
        out.at.append(t)
        out.took.append(took)
        stop.wait(max(0.0, PROBE_S - (time.time() - t)))


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln and not ln.startswith("#")}


def watch_open(url: str, pid: int | None, peak: list[float], rss: list[int],
               stop: threading.Event) -> None:
    """Sample the server's open connections (and its resident memory, when it is ours)."""
    while not stop.wait(1.0):
        try:
            peak.append(metrics(url)["switchboard_connections_open"])
        except (httpx.HTTPError, KeyError):
            pass
        if pid is not None:
            rss.append(resident_kib(pid))


def resident_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.main", "serve", "--port", "0",
                                 *flags], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while not (m := re.search(r"serving \S+ at (http://\S+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server failed:\n{log.read_text()}")
        time.sleep(0.2)
    return proc, m.group(1)


# -- the report -----------------------------------------------------------------------------


def row(name: str, probes: Probes, start: float, end: float) -> str:
    took = [t for a, t in zip(probes.at, probes.took, strict=True) if start <= a < end]
    ok = sorted(t * 1000 for t in took if t is not None)
    if not ok:
        return f"| {name} | {len(took)} | {len(took)} | - | - | - |"
    p99 = ok[min(len(ok) - 1, int(0.99 * len(ok)))]
    return (f"| {name} | {len(took)} | {len(took) - len(ok)} | {statistics.median(ok):.1f} | "
            f"{p99:.1f} | {ok[-1]:.1f} |")


def report(args: argparse.Namespace, probes: Probes, times: dict[str, float],
           stats: list[int], before: dict[str, float], after: dict[str, float],
           peak: list[float], settled: float, memory: tuple[int, int]) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import describe  # imports torch: only once the workers are done

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()

    def dropped(reason: str) -> int:
        key = f'switchboard_connections_dropped_total{{reason="{reason}"}}'
        return int(after.get(key, 0) - before.get(key, 0))

    a, s, e = times["attack"], times["held"], times["end"]
    lines = [
        "# Slow clients: /health during a flood of slow connections",
        "",
        f"Machine: {describe()}; {time.strftime('%Y-%m-%d')}, commit {commit}. "
        f"`benchmarks/slow_clients.py --connections {args.connections} --duration "
        f"{args.duration:g}`: {args.connections} connections from {args.workers} processes "
        f"at nice {NICE} (every {args.silent_every}nd sends nothing, the others one header "
        f"byte every {args.interval:g} s, never ending their headers; those the server closed "
        f"are opened again at the next round), against `switchboard serve` on the embedded "
        f"model ({args.serve_flags or 'its defaults'}: `--header-timeout 10`, a cap of "
        f"{args.cap} connections under the open-file limit {args.fd_limit}), on loopback. A "
        f"probe opens a fresh connection for `GET /health` every {PROBE_S:g} s (timeout "
        f"{PROBE_TIMEOUT_S:g} s, as a failure).",
        "",
        "| phase | probes | failed | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---:|---:|---:|---:|---:|",
        row("before the attack", probes, 0, a),
        row(f"ramp (the first {s - a:.0f} s)", probes, a, s),
        row("held", probes, s, e),
        row("**the whole attack**", probes, a, e),
        row("after it", probes, e, float("inf")),
        "",
        "| what | count |",
        "|---|---:|",
        f"| connections the attack opened (with reopenings) | {stats[0]} |",
        f"| ... answered 503 `too_many_connections` (refused: all busy) | {stats[1]} |",
        f"| ... answered 408 (header deadline) | {stats[2]} |",
        f"| ... closed without an answer (their place taken at the cap) | {stats[3]} |",
        f"| connect errors | {stats[4]} |",
        f"| server: connections open at most (sampled every 1 s) | {max(peak, default=0):.0f} |",
        f"| server: cap (`switchboard_connections_max`) | {after.get('switchboard_connections_max', 0):.0f} |",  # noqa: E501
        f"| server: closed at the header deadline | {dropped('header_timeout')} |",
        f"| server: evicted (place taken) | {dropped('evicted')} |",
        f"| server: refused (all busy) | {dropped('refused')} |",
        f"| server: connections open {settled:.0f} s after the attack | "
        f"{after.get('switchboard_connections_open', 0):.0f} |",
    ]
    if memory[0]:
        lines.append(f"| server: resident memory before / at most during (MiB) | "
                     f"{memory[0] / 1024:.0f} / {memory[1] / 1024:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=20000)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of attack")
    ap.add_argument("--ramp", type=float, default=10.0, help="the first seconds, reported apart")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between header bytes")
    ap.add_argument("--silent-every", type=int, default=2, help="every Nth connection is silent")
    ap.add_argument("--workers", type=int, default=2, help="attacking processes")
    ap.add_argument("--url", help="an already running server (else one is started)")
    ap.add_argument("--serve-flags", default="", help="for the started server, e.g. "
                    "'--max-connections 1000'")
    ap.add_argument("--out", type=Path, help="write the markdown table here")
    args = ap.parse_args()

    args.fd_limit = raise_fd_limit()  # the started server inherits it (and raises its own)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.serve_flags.split())
    try:
        parts = urlsplit(url)
        addr = (parts.hostname or "127.0.0.1", parts.port or 80)
        before = metrics(url)
        args.cap = int(before["switchboard_connections_max"])
        probes, peak, rss, stop = Probes(), [], [], threading.Event()
        pid = proc.pid if proc is not None else None
        rss0 = resident_kib(pid) if pid is not None else 0
        threads = [threading.Thread(target=probe, args=(addr, probes, stop)),
                   threading.Thread(target=watch_open, args=(url, pid, peak, rss, stop))]
        for t in threads:
            t.start()
        time.sleep(5)  # the "before" probes
        times = {"attack": time.time()}
        times["held"] = times["attack"] + args.ramp
        times["end"] = times["attack"] + args.duration
        stats = mp.get_context("fork").Array("q", len(STATS))
        share = [args.connections // args.workers + (i < args.connections % args.workers)
                 for i in range(args.workers)]
        workers = [mp.get_context("fork").Process(
            target=attack, args=(addr, k, args.silent_every, args.interval, times["end"], stats))
            for k in share]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        times["end"] = min(times["end"], time.time())
        time.sleep(5)  # the "after" probes, and the server settling
        stop.set()
        for t in threads:
            t.join()
        after = metrics(url)
        settled = time.time() - times["end"]
        memory = (rss0, max(rss, default=rss0))
        text = report(args, probes, times, list(stats), before, after, peak, settled, memory)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

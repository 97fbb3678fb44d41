"""The gateway's CPU cost per streamed token, this tree against a base revision, same run.

On a GPU the engine thread's host work overlaps the device, and it shares the GIL with the
event loop that streams every token to its client (`http_vs_offline_c128` in
benchmarks/gpu_e2e.py). This measures the event loop's side on any machine: `switchboard serve`
on `synthetic:tiny` with N concurrent streaming clients on /v1/completions, and the CPU seconds
each server thread spent during the timed run (Linux `/proc/<pid>/task/<tid>/stat`) per output
token. Server threads are told apart by their Python names, which a start-up hook copies into
their OS names. Rounds alternate base and this tree; each server is warmed by a same-shaped
workload of other tokens first.

    .venv/bin/python benchmarks/gateway_cpu.py --base HEAD~1 [--rounds 2] [--clients 64]
        [--out benchmarks/results/gateway_cpu.md]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import http_workload, mixed_workload  # noqa: E402
from machine import describe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLK = os.sysconf("SC_CLK_TCK")
# Run before the server: every thread started from `threading` copies its Python name into its
# OS name (15 bytes) on its first profiled call, then stops profiling itself.
HOOK = """
import sys, threading
def _name(frame, event, arg):
    sys.setprofile(None)
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(threading.current_thread().name[:15])
    except OSError:
        pass
threading.setprofile(_name)
if LOOP_HTTP:  # uvicorn's event loop and HTTP parser for this server (ServerThread sets none)
    import uvicorn
    _init = uvicorn.Config.__init__
    def _config(self, *a, **k):
        k.setdefault("loop", LOOP_HTTP[0]); k.setdefault("http", LOOP_HTTP[1])
        _init(self, *a, **k)
    uvicorn.Config.__init__ = _config
from gateway.main import main
sys.exit(main())
"""
THREADS = ("uvicorn", "engine-loop")


def serve(root: Path, flags: list[str],
          loop_http: tuple[str, str] | None) -> tuple[subprocess.Popen, str]:
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    hook = f"LOOP_HTTP = {loop_http!r}\n" + HOOK
    proc = subprocess.Popen([sys.executable, "-c", hook, "serve", "--port", "0", "--log-level",
                             "warning", *flags], cwd=root, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(root)})
    deadline = time.monotonic() + 180
    while not (m := re.search(r"serving \S+ at (http://\S+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, m.group(1)


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per OS thread name."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # exited meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK
    return out


def one_round(root: Path, flags: list[str], clients: int, requests: int,
              loop_http: tuple[str, str] | None = None) -> dict:
    proc, url = serve(root, flags, loop_http)
    try:
        vocab = 49152
        warm, warm_out = mixed_workload(requests, vocab, 0.25, seed=8)
        http_workload(url, warm, warm_out, clients)
        prompts, outputs = mixed_workload(requests, vocab, 0.25)
        before = thread_cpu(proc.pid)
        res = http_workload(url, prompts, outputs, clients)
        after = thread_cpu(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    tokens = sum(outputs)
    us = {n: (after[n] - before.get(n, 0.0)) / tokens * 1e6 for n in after}
    named = {n: us.get(n, 0.0) for n in THREADS}
    named["other"] = sum(v for n, v in us.items() if n not in THREADS)
    return {"tok_s": res["tok_s"], "errors": res["errors"], "us_per_token": named}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--base-uvicorn", metavar="LOOP,HTTP",
                    help="uvicorn's loop and HTTP implementation for the base's server, e.g. "
                         "asyncio,h11 (default: what uvicorn picks, as for this tree)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    base_uvicorn = tuple(args.base_uvicorn.split(",")) if args.base_uvicorn else None
    flags = ["--model", "synthetic:tiny", "--device", "cpu", "--dtype", "float32",
             "--max-num-seqs", str(args.clients), "--max-num-batched-tokens", "2048",
             "--kv-pages", "4000", "--max-queue", "4096", "--max-loras", "0"]
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base],
                         capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        runs: dict[str, list[dict]] = {"base": [], "this": []}
        for _ in range(args.rounds):
            for name, root, loop_http in (("base", base, base_uvicorn), ("this", ROOT, None)):
                r = one_round(root, flags, args.clients, args.requests, loop_http)
                runs[name].append(r)
                print(name, r, flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r["us_per_token"][key] for r in runs[name])

    how = f" --base-uvicorn {args.base_uvicorn}" if base_uvicorn else ""
    lines = [f"# Gateway CPU per streamed token: this tree vs {rev}{how}", "",
             f"Machine: {describe()}. `benchmarks/gateway_cpu.py --base {args.base}{how}`: "
             f"`synthetic:tiny` on the CPU, {args.clients} streaming clients, {args.requests} "
             f"requests on /v1/completions, {args.rounds} alternating rounds (medians).", "",
             "| thread | base us/token | this us/token | this / base |", "|---|---|---|---|"]
    for key in (*THREADS, "other"):
        b, t = med("base", key), med("this", key)
        lines.append(f"| {key} | {b:.1f} | {t:.1f} | {t / b:.3f} |" if b else
                     f"| {key} | {b:.1f} | {t:.1f} | - |")
    tok = {n: statistics.median(r["tok_s"] for r in runs[n]) for n in runs}
    lines += ["", f"Output tokens/s (median): base {tok['base']:.0f}, this {tok['this']:.0f} "
              "(the tiny model's CPU forward and the clients share this machine's cores: not "
              "the figure compared)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

"""A hostile tenant against `switchboard serve --redis-url`, and what its neighbour sees.

Starts a real redis-server and `switchboard serve` (the embedded model, CPU) with two tenants
of the default quotas unless told otherwise, then replays the growth attacks of the
"Hardening, round two" issue and their neighbours (forks of a 4 MB history, conversation
items, sessions by the thousand, stored responses, out-of-range TTLs and sampling values),
and fills Redis to its `maxmemory` (`noeviction`). Between attacks the neighbour creates a
session, takes a turn and stores a response. It reports, per attack: the answers by status,
the server errors (5xx, which must be 0), the attacker's bytes in Redis against its quota,
and whether the neighbour was served.

    .venv/bin/python benchmarks/hostile_tenant.py [--quota-mb 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from redis_server import RedisServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"


class Stack:
    def __init__(self, tmp: Path, quota_bytes: int):
        self.redis = RedisServer().__enter__()
        self.redis_url = self.redis.url
        self.db = redis.Redis.from_url(self.redis_url, decode_responses=True)
        # One attacker tenant per attack, each with the quota; the neighbour has the defaults.
        keys: dict[str, object] = {
            f"sk-attacker{i}": {"tenant": f"attacker{i}", "max_storage_bytes": quota_bytes}
            for i in range(len(ATTACKS))}
        keys["sk-neighbour"] = "neighbour"
        self.attacker = "attacker0"
        (tmp / "keys.json").write_text(json.dumps(keys))
        log = tmp / "serve.log"
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.main", "serve", "--port", "0", "--api-keys",
                 str(tmp / "keys.json"), "--redis-url", self.redis_url, "--max-num-seqs", "8",
                 "--kv-pages", "256"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 300
        while not (m := re.search(r"serving \S+ at (http://\S+)", log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(log.read_text())
            time.sleep(0.2)
        self.http = httpx.Client(base_url=m.group(1), timeout=120)

    def call(self, method: str, path: str, key: str, body: object = None) -> httpx.Response:
        key = self.attacker if key == "attacker" else key
        return self.http.request(method, path, json=body,
                                 headers={"Authorization": f"Bearer sk-{key}"})

    def attacker_bytes(self) -> int:
        return int(self.db.hget(f"switchboard:usage:{self.attacker}:totals", "bytes") or 0)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.redis.__exit__()


def neighbour_ok(s: Stack) -> bool:
    r = s.call("POST", "/v1/sessions", "neighbour", {"model": MODEL})
    if r.status_code != 200:
        return False
    turn = s.call("POST", "/v1/chat/completions", "neighbour", {
        "model": MODEL, "session_id": r.json()["id"], "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}]})
    resp = s.call("POST", "/v1/responses", "neighbour", {
        "model": MODEL, "input": "Hi", "max_output_tokens": 4, "temperature": 0})
    return turn.status_code == 200 and resp.status_code == 200


def fork_flood(s: Stack) -> list[int]:
    big = [{"role": "user", "content": "x" * 1_000_000}] * 4  # 4 MB history, one request
    r = s.call("POST", "/v1/sessions", "attacker", {"model": MODEL, "messages": big})
    codes = [r.status_code]
    if r.status_code == 200:
        sid = r.json()["id"]
        codes += [s.call("POST", f"/v1/sessions/{sid}/fork", "attacker", {}).status_code
                  for _ in range(50)]
    return codes


def conversation_growth(s: Stack) -> list[int]:
    conv = s.call("POST", "/v1/conversations", "attacker", {})
    codes = [conv.status_code]
    items = [{"type": "message", "role": "user", "content": "y" * 190_000}] * 20
    for _ in range(30):
        codes.append(s.call("POST", f"/v1/conversations/{conv.json()['id']}/items", "attacker",
                            {"items": items}).status_code)
    return codes


def many_sessions(s: Stack) -> list[int]:
    return [s.call("POST", "/v1/sessions", "attacker", {"model": MODEL}).status_code
            for _ in range(2000)]


def stored_responses(s: Stack) -> list[int]:
    return [s.call("POST", "/v1/responses", "attacker", {
        "model": MODEL, "input": "z" * 3000, "max_output_tokens": 2, "temperature": 0,
        "store": True}).status_code for _ in range(40)]


def bad_values(s: Stack) -> list[int]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    bodies: list[tuple[str, object]] = [
        ("/v1/sessions", {"model": MODEL, "ttl_seconds": 2**62}),
        ("/v1/chat/completions", {**chat, "stop_token_ids": [-1]}),
        ("/v1/chat/completions", {**chat, "stop_token_ids": [10**20]}),
        ("/v1/chat/completions", {**chat, "stop_token_ids": list(range(200_000))}),
        ("/v1/responses", {"model": MODEL, "input": "Hi", "text": {"format": "json_object"}}),
    ]
    codes = [s.call("POST", path, "attacker", body).status_code for path, body in bodies]
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], ' \
          b'"repetition_penalty": Infinity}' % MODEL.encode()
    codes.append(s.http.post("/v1/chat/completions", content=raw, headers={
        "Authorization": f"Bearer sk-{s.attacker}",
        "Content-Type": "application/json"}).status_code)
    return codes


def full_redis(s: Stack) -> list[int]:
    """Every write route while Redis refuses writes; then Redis gets room again."""
    s.db.config_set("maxmemory-policy", "noeviction")
    s.db.config_set("maxmemory", max(1, int(s.db.info("memory")["used_memory"]) - 4096))
    try:
        codes = [s.call("POST", "/v1/sessions", "neighbour", {"model": MODEL}).status_code]
        for path, body in [
            ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2}),
            ("/v1/conversations", {}),
            ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "Hi"}]}),
        ]:
            codes.append(s.call("POST", path, "neighbour", body).status_code)
        return codes
    finally:
        s.db.config_set("maxmemory", 0)


ATTACKS: list[tuple[str, Callable[[Stack], list[int]]]] = [
    ("50 forks of a 4 MB session", fork_flood),
    ("30 x 20 items of 190 KB into one conversation", conversation_growth),
    ("2,000 sessions", many_sessions),
    ("40 stored responses of 3 KB", stored_responses),
    ("ttl 2^62, stop_token_ids -1 / 1e20 / 200k, text.format string, Infinity", bad_values),
    ("Redis full (noeviction): the neighbour's writes", full_redis),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quota-mb", type=float, default=32.0,
                    help="the attacker's max_storage_bytes, MiB")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    quota = int(args.quota_mb * 2**20)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp), quota)
        try:
            for i, (name, attack) in enumerate(ATTACKS):
                stack.attacker = f"attacker{i}"
                t = time.monotonic()
                codes = attack(stack)
                seconds = time.monotonic() - t
                counts = collections.Counter(codes)
                rows.append((name, dict(sorted(counts.items())),
                             sum(n for c, n in counts.items() if c >= 500 and c != 503),
                             stack.attacker_bytes(), neighbour_ok(stack), seconds))
                print(rows[-1], flush=True)
            redis_mb = int(stack.db.info("memory")["used_memory"]) / 2**20
        finally:
            stack.close()
    lines = [f"# A hostile tenant against one server ({describe()}, "
             f"{time.strftime('%Y-%m-%d')})", "",
             f"Each attack by its own tenant of `max_storage_bytes` {quota:,} "
             f"({args.quota_mb:g} MiB); its stored bytes are its storage ledger's count. 503s "
             "are `store_unavailable` (Redis full), the answer the issue asks for; the 5xx "
             "column counts any other server error. `benchmarks/hostile_tenant.py`.", "",
             "| Attack | Answers (status: count) | other 5xx | Attacker's stored bytes | "
             "Neighbour served | Seconds |", "| --- | --- | --- | --- | --- | --- |"]
    for name, counts, errors, used, ok, seconds in rows:
        answers = ", ".join(f"{c}: {n}" for c, n in counts.items())
        lines.append(f"| {name} | {answers} | {errors} | {used:,} | {'yes' if ok else 'NO'} | "
                     f"{seconds:.1f} |")
    lines += ["", f"Redis' used memory at the end: {redis_mb:.1f} MiB."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

"""The host KV tier on a GPU: a session turn whose history was evicted to host memory vs the
same session's turns with the history cached on the device, and the tier's copy bandwidth vs
plain pinned copies measured in the same process.

    python3 benchmarks/gpu_kv_tiers.py --out SECTIONS.jsonl [--model synthetic:llama3-8b]

A worker of benchmarks/gpu_suite.py (its part `kv_tiers`): one section, `kv_tiers`, appended
to --out as a JSON line.

For each of 4 sessions (the first a warm-up): a cold first turn (4,096 + 64 tokens), a cached
second turn, then the session is unpinned and every device page evicted (its KV is on the
host already: sessions are written through), a third turn loads it back, and a fourth turn is
cached again. `session_ttft_host_tier_vs_cached_4k` = median TTFT of the third turns ÷ median
of the second and fourth; `host_load_bw_fraction` = the tier's host->device bytes ÷ its copy
time ÷ the pinned host->device bandwidth; likewise `host_offload_bw_fraction`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from gpu_common import Recorder, first_token, greedy, random_prompts

from engine import LLM
from engine.kv.host import HostKVPool


def pinned_bandwidth(gib: float = 1.0, reps: int = 10) -> tuple[float, float]:
    """(host->device, device->host) bytes/s of one pinned buffer copy, medians."""
    host = torch.empty(int(gib * 2**30), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    out = []
    for dst, src in ((dev, host), (host, dev)):
        times = []
        for _ in range(reps + 2):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out.append(host.numel() / statistics.median(times[2:]))
    return out[0], out[1]


def pool_bandwidth(eng, chunk: int, num_pages: int = 256, reps: int = 5) -> dict[str, float]:
    """GB/s of a host pool's offload and load of `num_pages` consecutive pages through
    `chunk`-page staging buffers, alone (wall clock around a synchronized copy, median)."""
    pool = HostKVPool(eng.runner.kv_pool, num_pages, eng.cfg.page_size, chunk)
    pages = list(range(num_pages))
    out = {}
    for name, fn in (("offload", lambda: pool.offload(pages, pages)),
                     ("load", lambda: pool.load(pages, pages))):
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[f"{name}_gb_s"] = round(num_pages * pool.page_bytes / statistics.median(times[1:])
                                    / 1e9, 1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()  # the host's time to queue it
        out[f"{name}_queue_ms"] = round((time.perf_counter() - t) * 1e3, 2)
        torch.cuda.synchronize()
    return out


def under_load(eng, vocab: int, history: int, turn: int, seed: int, batch: int = 12) -> dict:
    """A host-tier session turn arriving while `batch` requests decode (seats left for it:
    `max_num_seqs` is 16): its TTFT, and the decode steps' times before it arrives and until
    its first token (the batch must not wait for its copy)."""
    cache = eng.prefix_cache
    hist, t1, t2 = random_prompts(3, [history, turn, turn], seed=seed, vocab=vocab)
    eng.add_request("u1", hist + t1, greedy(1), session_id="u")
    while eng.has_unfinished_requests():
        eng.step()
    eng.release_session("u")
    cache.make_room(eng.allocator.num_pages)  # the session's KV: on the host only
    for i, p in enumerate(random_prompts(batch, 512, seed=seed + 1, vocab=vocab)):
        eng.add_request(f"bg{i}", p, greedy(400))
    for _ in range(8):  # all prefilled and decoding
        eng.step()

    def timed_step() -> tuple[float, list]:
        t = time.perf_counter()
        outs = eng.step()
        return time.perf_counter() - t, outs

    before = [timed_step()[0] for _ in range(30)]
    t0 = time.perf_counter()
    eng.add_request("u2", hist + t1 + [0] + t2, greedy(1), session_id="u")
    during, ttft = [], None
    while ttft is None:
        dt, outs = timed_step()
        during.append(dt)
        if any(o.request_id == "u2" and o.new_token_ids for o in outs):
            ttft = time.perf_counter() - t0
    for i in range(batch):
        eng.abort_request(f"bg{i}")
    while eng.has_unfinished_requests():
        eng.step()
    eng.release_session("u")
    return {"host_turn_ttft_ms": round(ttft * 1e3, 2),
            "decode_step_ms_before": round(statistics.median(before) * 1e3, 2),
            "decode_step_ms_max_before": round(max(before) * 1e3, 2),
            "steps_until_first_token_ms": [round(x * 1e3, 2) for x in during]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds for the whole worker")
    ap.add_argument("--adapter-dir", type=Path, help="unused (the suite passes it to workers)")
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--turn", type=int, default=64)
    args = ap.parse_args()
    with Recorder(args.out, args.budget).section("kv_tiers", args.budget) as s:
        s.result.update(measure(args.model, args.history, args.turn))


def measure(model: str, history: int, turn: int) -> dict:
    llm = LLM(model, dtype="bfloat16", device="cuda", max_num_seqs=16,
              max_num_batched_tokens=8192, num_pages=3000, host_kv_gb=16)
    eng = llm.engine
    h2d, d2h = pinned_bandwidth()
    # Before any request: the device pages these write hold nothing yet.
    alone = {chunk: pool_bandwidth(eng, chunk) for chunk in (8, 32, 128)}
    vocab = eng.model_config.vocab_size

    def ttft(rid: str, prompt: list[int], session: str) -> tuple[float, int, int]:
        return first_token(eng, rid, prompt, session)

    cold, cached, host, hits, eager = [], [], [], [], []
    cache = eng.prefix_cache
    for k in range(4):
        hist, t1, t2, t3, t4 = random_prompts(5, [history] + [turn] * 4, seed=200 + k,
                                              vocab=vocab)
        sess = f"sess-{k}"
        c, tok1, _ = ttft(f"c{k}", hist + t1, sess)
        turn2 = hist + t1 + [tok1] + t2
        w2, tok2, _ = ttft(f"w{k}", turn2, sess)
        eng.release_session(sess)
        assert cache.make_room(eng.allocator.num_pages)  # the whole device pool: all moves
        assert cache.tree.cached_pages == 0
        before = cache.stats()
        turn3 = turn2 + [tok2] + t3
        h, tok3, hit = ttft(f"h{k}", turn3, sess)
        after = cache.stats()
        turn4 = turn3 + [tok3] + t4
        w4, tok4, _ = ttft(f"w4{k}", turn4, sess)
        # A cached turn without CUDA graphs: the eager forward a host-tier turn overlaps
        # its load with (a graph cannot wait for the copy layer by layer).
        graphs = eng.runner.graphs, eng.runner.extend_graphs
        eng.runner.graphs = eng.runner.extend_graphs = None
        e5, _, _ = ttft(f"e5{k}", turn4 + [tok4] + t1, sess)
        eng.runner.graphs, eng.runner.extend_graphs = graphs
        eng.release_session(sess)
        if not k:  # the warm-up's copies include first-launch costs
            torch.cuda.synchronize()
            warm_copy = cache.stats().copy
        if k:
            cold.append(c)
            cached += [w2, w4]
            host.append(h)
            eager.append(e5)
            hits.append((hit, after.host_hit_tokens - before.host_hit_tokens))
    torch.cuda.synchronize()
    under_load(eng, vocab, history, turn, seed=300)  # warm-up: a mixed step's first shapes
    busy = under_load(eng, vocab, history, turn, seed=400)
    copy = cache.stats().copy
    load_bw = ((copy.bytes_to_device - warm_copy.bytes_to_device)
               / (copy.seconds_to_device - warm_copy.seconds_to_device))
    offload_bw = ((copy.bytes_to_host - warm_copy.bytes_to_host)
                  / (copy.seconds_to_host - warm_copy.seconds_to_host))
    c, w, h = statistics.median(cold), statistics.median(cached), statistics.median(host)
    return {
        "session_ttft_host_tier_vs_cached_4k": round(h / w, 3),
        "host_load_bw_fraction": round(load_bw / h2d, 3),
        "host_offload_bw_fraction": round(offload_bw / d2h, 3),
        "device": torch.cuda.get_device_name(),
        "cold_ttft_ms": round(c * 1e3, 2), "cached_ttft_ms": round(w * 1e3, 2),
        "host_tier_ttft_ms": round(h * 1e3, 2), "cold_vs_cached": round(c / w, 2),
        "cached_eager_ttft_ms": round(statistics.median(eager) * 1e3, 2),
        "pinned_h2d_gb_s": round(h2d / 1e9, 1), "pinned_d2h_gb_s": round(d2h / 1e9, 1),
        "tier_load_gb_s": round(load_bw / 1e9, 1), "tier_offload_gb_s": round(offload_bw / 1e9, 1),
        "pool_alone": alone,
        "under_load_b12": busy,
        "host_turn_cached_tokens_and_host_hits": hits,
        "all_ms": {"cold": [round(x * 1e3, 2) for x in cold],
                   "cached": [round(x * 1e3, 2) for x in cached],
                   "host": [round(x * 1e3, 2) for x in host]},
    }


if __name__ == "__main__":
    main()

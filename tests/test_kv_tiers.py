"""The host KV tier on the real SmolLM2: KV evicted from the device pool moves to host memory
and comes back on a hit, bit for bit, so outputs are the same whether a prefix came from the
device, the host or nowhere; tenants never share; no page leaks on either tier."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import LLM
from engine.kv.host import HostKVPool, _paired_runs, _runs
from tests.test_prefix_cache_model import run

DEVICE_PAGES = 64  # 1,024 tokens at 16 a page: three of the prompts below do not fit together


@pytest.fixture(scope="module")
def tiered(smollm2_dir):
    return LLM(model=str(smollm2_dir), max_num_seqs=8, num_pages=DEVICE_PAGES,
               host_kv_pages=256).engine


@pytest.fixture()
def engine(tiered):
    tiered.reset_prefix_cache()
    yield tiered
    check_owners(tiered)
    tiered.reset_prefix_cache()
    cache = tiered.prefix_cache
    assert tiered.allocator.num_used == 0 and cache.tiers.host_allocator.num_used == 0


def check_owners(engine) -> None:
    """Every used page of either pool belongs to the tree, once."""
    cache = engine.prefix_cache
    host = [p for _, p in cache.tree.host.iter_pages()]
    assert len(host) == len(set(host)) == cache.tiers.host_allocator.num_used
    device = [p for _, p in cache.tree.iter_pages()]
    assert len(device) == len(set(device)) == engine.allocator.num_used


@pytest.fixture(scope="module")
def prompts(smollm2):
    tok = smollm2.tokenizer
    return [tok.encode(f"Tool result {k}: " + ", ".join(
        f"row {i} has value {(i * 7 + k) % 13}" for i in range(40))) for k in range(3)]


def test_prefix_from_the_host_gives_the_same_tokens(engine, prompts):
    prompt = prompts[0]
    cold, _ = run(engine, prompt)
    cache = engine.prefix_cache
    assert cache.make_room(engine.allocator.num_pages)  # the whole pool: everything moves
    assert cache.tree.cached_pages == 0 and cache.tree.host.cached_pages >= len(prompt) // 16
    before = cache.stats()
    warm, cached = run(engine, prompt)
    assert warm == cold
    assert cached >= len(prompt) - 2 * engine.cfg.page_size
    stats = cache.stats()
    assert stats.host_hit_tokens - before.host_hit_tokens == cached
    assert stats.loaded_pages - before.loaded_pages >= cached // 16
    assert stats.copy.bytes_to_host > 0 and stats.copy.bytes_to_device > 0


def test_more_sessions_than_the_device_holds(engine, prompts):
    """Three sessions whose KV cannot share the device pool: each next turn still starts from
    cached KV (from the host), with the tokens of a cold run."""
    first = [run(engine, p, session=f"s{k}") for k, p in enumerate(prompts)]
    assert engine.prefix_cache.tree.host.cached_pages > 0  # the pool overflowed into the host
    turns, replies = [], []
    for k, (p, (reply, _)) in enumerate(zip(prompts, first, strict=True)):
        turns.append(p + reply + engine.tokenizer.encode(" And the next row?"))
        tokens, cached = run(engine, turns[-1], session=f"s{k}")
        assert cached >= len(p)
        replies.append(tokens)
        check_owners(engine)
    assert engine.prefix_cache.stats().host_hit_tokens > 0
    for k in range(len(prompts)):
        engine.release_session(f"s{k}")
    for turn, tokens in zip(turns, replies, strict=True):
        engine.reset_prefix_cache()
        assert run(engine, turn) == (tokens, 0)  # the same tokens computed from scratch


def test_host_pages_stay_in_their_namespace(engine, prompts):
    run(engine, prompts[0], tenant="alpha")
    cache = engine.prefix_cache
    cache.make_room(engine.allocator.num_pages)
    host_hits = cache.stats().host_hit_tokens  # totals since start-up
    assert run(engine, prompts[0], tenant="beta")[1] == 0
    assert cache.stats().host_hit_tokens == host_hits
    assert run(engine, prompts[0], tenant="alpha")[1] > 0
    assert cache.stats().host_hit_tokens > host_hits
    for ns, _ in engine.prefix_cache.tree.host.iter_pages():
        assert ns[0] == "alpha"


def test_full_host_tier_evicts_its_lru(smollm2_dir, prompts):
    """A host tier smaller than what is evicted keeps the most recent KV and drops the rest;
    what it drops is recomputed, with the same tokens."""
    engine = LLM(model=str(smollm2_dir), max_num_seqs=4, num_pages=DEVICE_PAGES,
                 host_kv_pages=24).engine
    cold = [run(engine, p)[0] for p in prompts]
    cache = engine.prefix_cache
    assert cache.tree.host.cached_pages <= 24
    assert cache.tiers.host_allocator.num_used == cache.tree.host.cached_pages
    for p, tokens in zip(prompts, cold, strict=True):
        assert run(engine, p)[0] == tokens
        check_owners(engine)


FRAGMENTED = (list(range(70)), list(range(5, 40)) + list(range(50, 85))[::-1],
              list(range(79, 9, -1)))
CONSECUTIVE = (list(range(3, 73)), list(range(10, 80)), list(range(2, 40)) + list(range(42, 74)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("pages", [FRAGMENTED, CONSECUTIVE])
def test_pool_copies_are_exact(dtype, pages):
    check_pool_copies("cpu", dtype, *pages)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("pages", [FRAGMENTED, CONSECUTIVE])
@pytest.mark.parametrize("overlap", [False, True])
def test_pool_copies_are_exact_on_cuda(dtype, pages, overlap):
    check_pool_copies("cuda", dtype, *pages, overlap=overlap)


def check_pool_copies(device: str, dtype: torch.dtype, src: list[int], host: list[int],
                      dst: list[int], overlap: bool = False) -> None:
    """Pages offloaded and loaded into other device pages hold the same bits, over chunk
    boundaries, runs of pages that are and are not consecutive (on CUDA: the staged and the
    direct load), and a forward's per-layer wait."""
    torch.manual_seed(0)
    ps, layers, pages = 4, 3, 80
    kv_pool = torch.randn(layers, 2, (pages + 1) * ps, 2, 8, device=device).to(dtype)
    kv = [(kv_pool[i, 0], kv_pool[i, 1]) for i in range(layers)]  # the model's views
    pool = HostKVPool(kv_pool, 90, ps, chunk_pages=16)
    before = [(k.clone(), v.clone()) for k, v in kv]
    pool.offload(src, host)
    for k, v in kv:  # the offload is queued before these writes: it reads the old pages
        k.zero_(), v.zero_()
    handle = pool.load(host, dst, overlap=overlap)
    pool.use(handle)
    for _ in pool.layers(kv):  # what a forward does: wait for each layer's copy
        pass
    for (k, v), (k0, v0) in zip(kv, before, strict=True):
        kp, k0p = k.view(-1, ps, 2, 8), k0.view(-1, ps, 2, 8)
        vp, v0p = v.view(-1, ps, 2, 8), v0.view(-1, ps, 2, 8)
        assert torch.equal(kp[dst], k0p[src]) and torch.equal(vp[dst], v0p[src])
    if device == "cuda":
        torch.cuda.synchronize()  # the totals count copies that are done
    stats = pool.copy_stats()
    assert stats.bytes_to_host == stats.bytes_to_device == len(src) * pool.page_bytes


def test_runs():
    assert _runs([]) == []
    assert _runs([3, 4, 5, 9, 1, 2]) == [(3, 0, 3), (9, 3, 1), (1, 4, 2)]
    assert _paired_runs([3, 4, 5, 6], [7, 8, 1, 2]) == [(3, 7, 2), (5, 1, 2)]


# -- over HTTP: sessions beyond the device pool, with the openai SDK ------------------------


@pytest.fixture(scope="module")
def tier_server(tmp_path_factory):
    from tests.conftest import serve

    with serve(tmp_path_factory.mktemp("kv-tiers"), "--kv-pages", "48",
               "--host-kv-pages", "256") as server:
        yield server


def test_sessions_resume_from_the_host_tier_over_http(tier_server):
    import httpx
    from openai import OpenAI

    srv = tier_server
    client = OpenAI(base_url=srv.base_url, api_key=srv.api_key)
    http = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.api_key}"},
                        timeout=60)
    greedy = {"max_tokens": 8, "temperature": 0}
    sids = []
    for k in range(3):  # each history ~ 400 tokens: three do not fit 48 pages of 16
        rows = ", ".join(f"row {i} has value {(i * 7 + k) % 13}" for i in range(45))
        r = http.post("/v1/sessions", json={"model": srv.model, "messages": [
            {"role": "system", "content": f"Tool result {k}: {rows}"}]})
        assert r.status_code == 200, r.text
        sids.append(r.json()["id"])
    first = [client.chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": "Which row is largest?"}],
        extra_body={"session_id": sid}, **greedy) for sid in sids]
    before = srv.metrics()
    assert before['switchboard_kv_tier_pages{tier="host"}'] > 0
    for sid, r1 in zip(sids, first, strict=True):
        r2 = client.chat.completions.create(
            model=srv.model, messages=[{"role": "user", "content": "And the smallest?"}],
            extra_body={"session_id": sid}, **greedy)
        assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 16
    after = srv.metrics()
    host_hits = 'switchboard_kv_tier_hit_tokens_total{tier="host"}'
    assert after[host_hits] > before[host_hits]
    assert after['switchboard_kv_tier_copy_bytes_total{direction="to_device"}'] > 0
    assert after["switchboard_kv_tier_host_pages_total"] == 256


# -- the disk tier: sessions across a restart ----------------------------------------------


def _session_turns(engine, prompts, session="S"):
    """A session's first turn on `prompts[0]`; returns the second turn's prompt."""
    reply, _ = run(engine, prompts[0], session=session)
    return prompts[0] + reply + engine.tokenizer.encode(" And the next row?")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_restarted_engine_resumes_sessions_from_disk(smollm2_dir, prompts, tmp_path,
                                                       kv_cache_dtype):
    """Engine A writes a session's KV through to disk; engine B, started fresh on the same
    folder, computes the next turn from the files: the same tokens as a cold run (an FP8 KV
    cache too: its pages move as their bytes)."""
    kw = dict(model=str(smollm2_dir), max_num_seqs=4, num_pages=DEVICE_PAGES, host_kv_pages=64,
              kv_disk_dir=tmp_path, kv_cache_dtype=kv_cache_dtype)
    a = LLM(**kw).engine
    turn = _session_turns(a, prompts)
    a.prefix_cache.tiers.disk.flush()
    written = a.prefix_cache.stats().disk_pages_written
    assert written >= len(prompts[0]) // 16
    cold = run(a, turn, tenant="cold")  # another tenant: nothing cached
    del a

    b = LLM(**kw).engine
    tokens, cached = run(b, turn, session="S2")
    assert tokens == cold[0]
    assert cached >= len(prompts[0]) - 16
    stats = b.prefix_cache.stats()
    assert stats.disk_hit_tokens >= len(prompts[0]) - 16 and stats.disk_pages_rejected == 0
    check_owners(b)
    b.release_session("S2")
    b.reset_prefix_cache()
    assert b.prefix_cache.tiers.host_allocator.num_used == 0


def test_a_restarted_engine_finds_a_sessions_kv_under_its_adapter(smollm2_dir, hf_smollm2,
                                                                   prompts, tmp_path):
    """KV computed under an adapter is keyed by its files: engine B, registering the same
    adapter folder after a restart, reads the session's pages from disk."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)
    lora = peft.get_peft_model(copy.deepcopy(hf_smollm2), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "bot")
    kw = dict(model=str(smollm2_dir), max_num_seqs=4, num_pages=DEVICE_PAGES, host_kv_pages=64,
              kv_disk_dir=tmp_path / "kv")
    a = LLM(**kw)
    a.load_adapter("bot", tmp_path / "bot")
    reply, _ = run(a.engine, prompts[0], adapter="bot", session="S")
    turn = prompts[0] + reply + a.tokenizer.encode(" And the next row?")
    a.engine.prefix_cache.tiers.disk.flush()
    a.engine.release_session("S")
    a.engine.reset_prefix_cache()
    cold = run(a.engine, turn, adapter="bot")  # no session: the files are not read
    assert cold[1] == 0
    del a

    b = LLM(**kw)
    b.load_adapter("bot", tmp_path / "bot")
    tokens, cached = run(b.engine, turn, adapter="bot", session="S2")
    assert tokens == cold[0]
    assert cached >= len(prompts[0]) - 16
    assert b.engine.prefix_cache.stats().disk_hit_tokens >= len(prompts[0]) - 16
    b.engine.release_session("S2")


def test_corrupt_or_foreign_page_files_are_refused(smollm2_dir, prompts, tmp_path):
    """A page file whose payload changed, or one written for another model, is not used: the
    request computes from there on, with the tokens of a cold run."""
    kw = dict(model=str(smollm2_dir), max_num_seqs=4, num_pages=DEVICE_PAGES, host_kv_pages=64,
              kv_disk_dir=tmp_path)
    a = LLM(**kw).engine
    turn = _session_turns(a, prompts)
    a.prefix_cache.tiers.disk.flush()
    cold = run(a, turn, tenant="cold")
    disk = a.prefix_cache.tiers.disk
    keys = disk.keys(("default", None, 0), turn, 16, len(prompts[0]) // 16)
    del a
    bad = disk.dir / f"{keys[5]}.kvpage"
    data = bytearray(bad.read_bytes())
    data[-7] ^= 0xFF  # one byte of the payload
    bad.write_bytes(bytes(data))

    b = LLM(**kw).engine
    tokens, cached = run(b, turn, session="S2")
    assert tokens == cold[0]
    assert 5 * 16 <= cached < 6 * 16  # the pages before the corrupt one only
    assert b.prefix_cache.stats().disk_pages_rejected == 1
    del b

    # Another model's files: the same folder, another fingerprint (dtype) sees none of them.
    c = LLM(**{**kw, "dtype": "bfloat16"}).engine
    assert c.prefix_cache.tiers.disk.dir != disk.dir and not c.prefix_cache.tiers.disk.index
    # ... and a file copied across under its names is refused by its header.
    theirs = c.prefix_cache.tiers.disk.keys(("default", None, 0), turn, 16, len(keys))
    for mine, other in zip(keys, theirs, strict=True):
        (c.prefix_cache.tiers.disk.dir / f"{other}.kvpage").write_bytes(
            (disk.dir / f"{mine}.kvpage").read_bytes())
    c.prefix_cache.tiers.disk.index = set(theirs)
    _, cached = run(c, turn, session="S3")
    assert cached == 0 and c.prefix_cache.stats().disk_pages_rejected == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_disk_round_trip_is_exact(device, tmp_path):
    """Device pages -> snapshot -> page files -> host pages -> device pages: the same bits."""
    from engine.kv.disk import DiskKV

    torch.manual_seed(1)
    ps, layers, pages = 4, 3, 40
    kv_pool = torch.randn(layers, 2, (pages + 1) * ps, 2, 8, dtype=torch.bfloat16, device=device)
    pool = HostKVPool(kv_pool, 32, ps, chunk_pages=8)
    disk = DiskKV(tmp_path, "f" * 64, (layers, 2, ps, 2, 8), torch.bfloat16)
    src = [3, 4, 5, 9, 20, 21]
    keys = disk.keys("ns", list(range(ps * len(src))), ps, len(src))
    snap, ready = pool.snapshot(src)
    before = kv_pool.view(layers, 2, pages + 1, ps, 2, 8)[:, :, src].clone()
    kv_pool.zero_()  # queued after the snapshot: it copied the old pages
    disk.write(keys, snap, ready)
    disk.flush()
    host = [30, 7, 8, 9, 1, 2]
    read = disk.read(keys, lambda i, page: pool.store(host[i], page),
                     before=pool.host_writes_done())
    assert read.result() == len(keys)
    dst = list(range(10, 16))
    handle = pool.load(host, dst)
    pool.use(handle)
    for _ in pool.layers([(kv_pool[i, 0], kv_pool[i, 1]) for i in range(layers)]):
        pass
    after = kv_pool.view(layers, 2, pages + 1, ps, 2, 8)[:, :, dst]
    assert torch.equal(after, before)


def test_disk_tier_keeps_to_its_size_least_recently_used_first(tmp_path):
    """Over `max_bytes`, the files least recently written or read go first; a restarted
    tier counts what the folder holds."""
    import os

    from engine.kv.disk import DiskKV

    shape = (2, 2, 4, 1, 8)
    disk = DiskKV(tmp_path, "a" * 64, shape, torch.float32)
    keys = disk.keys("ns", list(range(20)), 4, 5)
    disk.write(keys, torch.randn(5, *shape), lambda: None)
    disk.flush()
    assert disk.index == set(keys) and disk.pages_written == 5
    size = (disk.dir / f"{keys[0]}.kvpage").stat().st_size
    assert disk.nbytes == 5 * size
    for i, key in enumerate(keys):  # written at t = 1..5
        os.utime(disk.dir / f"{key}.kvpage", (i + 1, i + 1))
    got = []
    assert disk.read(keys[:1], lambda i, page: got.append(page), before=lambda: None).result() == 1
    disk.max_bytes = 3 * size
    disk._trim()
    assert disk.index == {keys[0], keys[3], keys[4]} and disk.pages_deleted == 2
    assert {f.stem for f in disk.dir.glob("*.kvpage")} == disk.index
    assert DiskKV(tmp_path, "a" * 64, shape, torch.float32).nbytes == 3 * size


@pytest.mark.gpu
def test_queued_offloads_are_timed_once():
    """An offload queued behind another on the copy stream counts the time its own transfer
    runs, not the time it waits: the seconds of back-to-back offloads add up to no more than
    the wall time around them."""
    kv_pool = torch.zeros(4, 2, 513 * 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    pool = HostKVPool(kv_pool, 512, 16)
    torch.cuda.synchronize()
    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    begin.record()
    for i in range(6):
        pages = list(range(64 * i, 64 * i + 64))
        pool.offload(pages, pages)
    end.record(pool.copy_stream)
    end.synchronize()
    stats = pool.copy_stats()
    assert stats.bytes_to_host == 6 * 64 * pool.page_bytes
    assert stats.seconds_to_host * 1e3 <= begin.elapsed_time(end) * 1.02

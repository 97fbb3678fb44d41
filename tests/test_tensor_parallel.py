"""Tensor parallelism on CPUs: two ranks over gloo give the tokens one rank gives.

The embedded SmolLM2 (9 query heads over 3 KV heads: split 1 and 2 over two ranks) with two
peft adapters and a JSON schema in the batch, and a synthetic model with one KV head
(replicated on both ranks), greedy, equal token for token to `tensor_parallel_size=1`. The
shards of every weight put back together are the whole model. A worker killed mid-generation
fails the step at once with the rank named, and a server goes not-ready and not live.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig, ModelLoadError
from engine.parallel.collectives import KVLoad, RankDied
from engine.parallel.partition import Partition, cut_fused
from engine.runner.synthetic import hf_config
from tests.tiny_models import random_peft_adapter

SYSTEM = "You are a careful assistant who answers in one short sentence and never rambles. "
PROMPTS = [SYSTEM + "The capital of France is", SYSTEM + "def fibonacci(n):"]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]},
                                           "population": {"type": "integer", "minimum": 0,
                                                          "maximum": 99999999}},
          "required": ["city", "population"], "additionalProperties": False}


def _cfg(**fields) -> ModelConfig:
    return ModelConfig(vocab_size=fields.pop("vocab_size", 1000), hidden_size=64,
                       intermediate_size=fields.pop("intermediate_size", 160), num_layers=2,
                       head_dim=16, max_position=512, **fields)


# -- the partition (no processes) ---------------------------------------------------------


def test_partition_splits_heads_by_kv_group_and_replicates_few_kv_heads():
    smol = _cfg(num_heads=9, num_kv_heads=3)  # SmolLM2-135M's heads
    p0, p1 = (Partition.of(smol, r, 2) for r in range(2))
    assert (p0.kv_heads, p0.q_heads) == ((0, 1), (0, 3))
    assert (p1.kv_heads, p1.q_heads) == ((1, 3), (3, 9))
    mqa = _cfg(num_heads=4, num_kv_heads=1)
    assert [(p.kv_heads, p.q_heads) for p in (Partition.of(mqa, r, 2) for r in range(2))] == [
        ((0, 1), (0, 2)), ((0, 1), (2, 4))]
    gqa = _cfg(num_heads=8, num_kv_heads=2)  # 4 ranks per KV head, one query head each
    assert [Partition.of(gqa, r, 8).q_heads for r in range(8)] == [(r, r + 1) for r in range(8)]
    with pytest.raises(ModelLoadError, match="cannot split 4 query heads over 2 KV heads"):
        Partition.of(_cfg(num_heads=4, num_kv_heads=2), 0, 8)
    odd = _cfg(num_heads=4, num_kv_heads=2, vocab_size=1001)
    assert [Partition.of(odd, r, 2).vocab_start for r in range(2)] == [0, 501]
    assert Partition.of(odd, 1, 2).vocab_rows == 501  # the last shard pads one row


@pytest.mark.parametrize("preset", ["tiny", "tiny-mqa", "qwen3-tiny"])
@pytest.mark.parametrize("size", [2, 4])
def test_shards_put_back_together_are_the_whole_model(preset, size):
    from engine.runner.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_hf(hf_config(preset))
    torch.manual_seed(0)
    whole = LlamaForCausalLM(cfg)
    with torch.no_grad():  # the embedding is made with torch.empty: NaN is never equal
        for p in whole.parameters():
            p.normal_()
    parts = [Partition.of(cfg, r, size) for r in range(size)]
    for name, t in whole.state_dict().items():
        shards = [cut_fused(name, t, p, cfg) for p in parts]
        local = dict(LlamaForCausalLM(cfg, parts[0]).state_dict())[name].shape
        assert shards[0].shape == local, name
        proj = name.split(".")[-2]
        if proj in ("embed_tokens", "lm_head"):
            assert torch.equal(torch.cat(shards)[: cfg.vocab_size], t), name
        elif proj in ("o_proj", "down_proj"):
            assert torch.equal(torch.cat(shards, dim=1), t), name
        elif proj == "gate_up_proj":
            halves = [s.chunk(2) for s in shards]
            assert torch.equal(torch.cat([h[0] for h in halves] + [h[1] for h in halves]), t)
        elif proj == "qkv_proj" and cfg.num_kv_heads >= size:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            pieces = [s.split([(p.q_heads[1] - p.q_heads[0]) * cfg.head_dim,
                               *[(p.kv_heads[1] - p.kv_heads[0]) * cfg.head_dim] * 2])
                      for s, p in zip(shards, parts, strict=True)]
            rebuilt = torch.cat([torch.cat([x[i] for x in pieces]) for i in range(3)])
            assert rebuilt.shape == (q + 2 * kv, cfg.hidden_size)
            assert torch.equal(rebuilt, t), name
        elif proj != "qkv_proj":  # norms: every rank holds all of it
            assert all(torch.equal(s, t) for s in shards), name


def test_a_rank_reads_only_its_slices_of_a_checkpoint(tmp_path):
    """The HF-folder path (sliced safetensors reads) gives the shards `cut_fused` cuts from
    the whole model: uneven KV heads, tied embeddings, a vocabulary two ranks split unevenly."""
    from engine.runner.loader import load_model
    from tests.tiny_models import save_tiny

    folder = save_tiny(tmp_path / "m", "llama", vocab_size=321, hidden_size=96,
                       num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True)
    whole = load_model(folder, torch.float32, "cpu").state_dict()
    cfg = ModelConfig.from_dir(folder)
    for rank in range(2):
        part = Partition.of(cfg, rank, 2)
        mine = load_model(folder, torch.float32, "cpu", part).state_dict()
        assert mine.keys() == whole.keys()
        for name, t in mine.items():
            assert torch.equal(t, cut_fused(name, whole[name], part, cfg)), (rank, name)


def test_two_ranks_load_a_prefix_back_from_the_host_tier(smollm2_dir, smollm2):
    """Each rank keeps its KV heads' share of every host page: a prefix evicted to the host
    tier and loaded back gives the cold run's tokens, and one rank's."""
    from tests.test_prefix_cache_model import run

    prompt = smollm2.tokenizer.encode("Tool result: " + ", ".join(
        f"row {i} has value {i * 7 % 13}" for i in range(30)))
    out = {}
    for size in (1, 2):
        with LLM(model=str(smollm2_dir), tensor_parallel_size=size, num_pages=64,
                 host_kv_pages=64, max_loras=0) as llm:
            engine, cache = llm.engine, llm.engine.prefix_cache
            cold, _ = run(engine, prompt)
            assert cache.make_room(engine.allocator.num_pages)  # every page to the host
            assert cache.tree.cached_pages == 0 and cache.tree.host.cached_pages > 0
            if size == 2:  # the worker's device pages lose the prefix: only its load restores it
                unused = cache.tiers.host_allocator.num_pages - 1
                engine.workers.tp.send(KVLoad([unused] * engine.allocator.num_pages,
                                              list(range(engine.allocator.num_pages))))
            warm, cached = run(engine, prompt)
            assert cached >= len(prompt) - 2 * engine.cfg.page_size
            assert cache.stats().host_hit_tokens == cached
            assert warm == cold
            out[size] = cold
    assert out[2] == out[1]


# -- two ranks against one ----------------------------------------------------------------


def _jobs(names: list[str]) -> tuple[list[str], list[SamplingParams]]:
    prompts, params = [], []
    for prompt in PROMPTS:
        for adapter in (None, *names):
            prompts.append(prompt)
            params.append(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                         adapter=adapter))
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    prompts.append(SYSTEM + "Describe Paris as JSON:")
    params.append(SamplingParams(max_tokens=48, temperature=0, response_format=rf))
    return prompts, params


def test_embedded_model_two_ranks_equal_one(smollm2_dir, hf_smollm2, tmp_path):
    """LoRA adapters (one on q/v, one on every projection) and a JSON schema in one batch;
    then the same prompts again, from the prefix cache."""
    pytest.importorskip("peft")
    random_peft_adapter(hf_smollm2, tmp_path / "poet", 1, r=8, lora_alpha=16,
             target_modules=["q_proj", "v_proj"])
    random_peft_adapter(hf_smollm2, tmp_path / "coder", 2, r=16, lora_alpha=16,
             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"])
    names = ["poet", "coder"]
    prompts, params = _jobs(names)
    results = {}
    for size in (1, 2):
        with LLM(model=str(smollm2_dir), tensor_parallel_size=size, num_pages=128,
                 max_loras=2, max_lora_rank=16) as llm:
            for name in names:
                llm.load_adapter(name, tmp_path / name)
            first = llm.generate(prompts, params)
            again = llm.generate(prompts, params)
            assert all(o.error is None for o in first + again), [o.error for o in first]
            assert sum(o.num_cached_tokens for o in again) > 0
            llm.engine.reset_prefix_cache()
            assert llm.engine.allocator.num_used == 0  # no page kept by any request
            base = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0,
                                                           logprobs=2))[0].logprobs
            results[size] = [o.token_ids for o in first], [o.token_ids for o in again], base
            schema_text = first[-1].text
        jsonschema.validate(json.loads(schema_text), SCHEMA)
    assert results[2][:2] == results[1][:2]
    # And the base rows' log-probabilities agree to float rounding (summed in another order).
    for lp2, lp1 in zip(results[2][2], results[1][2], strict=True):
        assert lp2.token_id == lp1.token_id
        assert lp2.logprob == pytest.approx(lp1.logprob, abs=1e-3)
    by_adapter = results[1][0]
    assert by_adapter[0] != by_adapter[2] or by_adapter[3] != by_adapter[5]  # LoRA is in play


def test_fewer_kv_heads_than_ranks_chunked_prefill(tmp_path):
    """One KV head replicated on both ranks; prompts longer than a step's token budget."""
    prompts = [[(7 * i + 3 * j) % 4000 + 10 for j in range(40 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    out = {}
    for size in (1, 2):
        with LLM(model="synthetic:tiny-mqa", cache_dir=tmp_path, tensor_parallel_size=size,
                 num_pages=64, page_size=8, max_num_batched_tokens=32, max_loras=0) as llm:
            out[size] = [o.token_ids for o in llm.generate(prompts, params)]
    assert out[2] == out[1]


def kill_rank_1_mid_generation(llm: LLM, max_tokens: int) -> tuple[int, float, RankDied]:
    """Kill rank 1 (SIGKILL) while four requests generate, then step until a step fails:
    (the worker's pid, seconds from the kill to the failure, the error)."""
    worker = llm.engine.workers.procs[0]
    llm.generate(["warm up"], SamplingParams(max_tokens=2))
    for rid in range(4):
        llm.engine.add_request(f"r{rid}", [10 + rid] * 8,
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    llm.engine.step()
    assert worker.pid is not None
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankDied) as failed:
        while True:
            llm.engine.step()
    return worker.pid, time.monotonic() - start, failed.value


def test_a_dead_rank_fails_the_step_at_once(tmp_path):
    llm = LLM(model="synthetic:tiny", cache_dir=tmp_path, tensor_parallel_size=2, num_pages=64,
              max_loras=0)
    try:
        pid, seconds, error = kill_rank_1_mid_generation(llm, max_tokens=400)
        assert f"rank 1 (pid {pid}) exited with code -9" in str(error)
        assert seconds < 10
        assert "rank 1" in llm.engine.fatal_error
    finally:
        llm.close()


def test_a_rank_dead_before_joining_fails_the_start_at_once(tmp_path):
    """A worker that exits before it joins the group (here killed while it imports) fails the
    engine's start with the reason at once, not after the rendezvous timeout."""
    import multiprocessing
    import threading

    killed: list[int] = []

    def kill_first_worker() -> None:
        deadline = time.monotonic() + 30
        while not killed and time.monotonic() < deadline:
            for p in multiprocessing.active_children():
                if p.name == "switchboard-tp1" and p.pid:
                    os.kill(p.pid, signal.SIGKILL)
                    killed.append(p.pid)
            time.sleep(0.001)

    killer = threading.Thread(target=kill_first_worker)
    killer.start()
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"rank 1 \(pid \d+\) exited with code -9 before"):
        LLM(model="synthetic:tiny", cache_dir=tmp_path, tensor_parallel_size=2, num_pages=64,
            max_loras=0)
    killer.join()
    assert killed and time.monotonic() - start < 20


def test_server_goes_not_ready_when_a_rank_dies(tmp_path):
    """Through the engine thread: an idle engine's readiness drops, and a request then fails
    with the reason instead of waiting."""
    from engine.ipc.async_engine import AsyncEngine
    from engine.messages import GenerateRequest

    async def run() -> None:
        engine = AsyncEngine(EngineConfig(model="synthetic:tiny", cache_dir=tmp_path,
                                          tensor_parallel_size=2, num_pages=64, max_loras=0))
        engine.start(asyncio.get_running_loop())
        assert await asyncio.to_thread(engine.wait_loaded, 120)
        assert engine.ready and engine.fatal_error is None
        os.kill(engine._engine.workers.procs[0].pid, signal.SIGKILL)
        for _ in range(100):
            if not engine.ready:
                break
            await asyncio.sleep(0.05)
        assert not engine.ready
        sink: asyncio.Queue = asyncio.Queue()
        engine.add_request(GenerateRequest("after", [5, 6, 7], SamplingParams(max_tokens=4)),
                           sink)
        out = await asyncio.wait_for(sink.get(), 30)
        assert out.finished and out.finish_reason == "error" and "rank 1" in out.error
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(run())


def test_serve_with_two_ranks_answers_the_openai_sdk(tmp_path):
    """`switchboard serve --tensor-parallel-size 2`: a streamed chat completion, and a tool
    call that parses against its schema."""
    from openai import OpenAI

    from tests.conftest import serve

    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
               "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    with serve(tmp_path, "--tensor-parallel-size", "2") as server:
        client = OpenAI(base_url=server.base_url, api_key=server.api_key)
        chunks = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
        reply = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=tools, tool_choice="required", max_tokens=40, temperature=0)
        calls = reply.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), weather)


def test_health_fails_once_a_rank_dies(tmp_path):
    """Liveness tells the truth: a rank's death ends its engine core; with no restarts left
    (`--engine-restarts 0`) the server can never serve again, so /health answers 503 with the
    reason (and a liveness probe restarts the pod), as /ready and requests do; until then it
    is 200. No process is left behind."""
    from tests.conftest import serve

    with serve(tmp_path, "--tensor-parallel-size", "2", "--engine-restarts", "0") as server:
        assert httpx.get(server.url + "/health").status_code == 200
        os.kill(_rank_pid(tmp_path / "keys.json"), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (r := httpx.get(server.url + "/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200 after the rank died"
            time.sleep(0.1)
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "engine_failed" and "rank 1" in error["message"]
        assert error["type"] == "server_error"
        ready = httpx.get(server.url + "/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "engine_failed"
        assert not [p for p in Path("/proc").iterdir() if p.name.isdigit()
                    and _parent(p.name) == str(server.pid) and b"spawn_main" in _cmdline(p)
                    ], "the engine core outlived its rank"


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def _parent(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except OSError:
        return ""


def _rank_pid(keys: Path) -> int:
    """The pid of rank 1 of the server started with this keys file: its engine core's
    `spawn` child."""
    def cmdline(pid: str) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return ""

    def parent(pid: str) -> str:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except OSError:
            return ""

    pids = [p.name for p in Path("/proc").iterdir() if p.name.isdigit()]
    server = next(p for p in pids if " serve " in cmdline(p) and str(keys) in cmdline(p))
    core = next(p for p in pids if parent(p) == server and "spawn_main" in cmdline(p))
    return int(next(p for p in pids if parent(p) == core and "spawn_main" in cmdline(p)))

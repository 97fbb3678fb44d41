"""Tensor parallelism on two GPUs (NCCL), everything on: CUDA graphs and piecewise graphs
capturing the collectives, the overlapped schedule, LoRA, a JSON schema, the prefix cache and
its host and disk tiers. Two ranks give one rank's tokens in float32; a server with two ranks
answers the openai SDK and drains on SIGTERM; a rank that dies fails the step, and closing an
engine returns. Marked `gpu`; skipped with fewer than two GPUs."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import jsonschema
import pytest
import torch

from engine import LLM
from tests.test_prefix_cache_model import run
from tests.test_tensor_parallel import PROMPTS, SCHEMA, _jobs, kill_rank_1_mid_generation
from tests.tiny_models import random_peft_adapter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two GPUs"),
]


def closed_within(llm: LLM, seconds: float) -> bool:
    """Close `llm` on a thread; did it return in time? (A teardown that waits on a captured
    graph would hang the test instead of failing it.)"""
    closing = threading.Thread(target=llm.close, daemon=True)
    closing.start()
    closing.join(seconds)
    return not closing.is_alive()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, list[str]]:
    """`synthetic:tiny` (4 query heads over 2 KV heads, the SmolLM2 tokenizer: no checkpoint
    to carry to a GPU machine) and two peft adapters for it: (its folder, adapter folders)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.runner.loader import resolve_model_dir

    root = tmp_path_factory.mktemp("tp-gpu")
    folder = resolve_model_dir("synthetic:tiny", root)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    random_peft_adapter(hf, root / "poet", 1, r=8, lora_alpha=16,
                        target_modules=["q_proj", "v_proj"])
    random_peft_adapter(hf, root / "coder", 2, r=16, lora_alpha=16,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"])
    return str(folder), [str(root / "poet"), str(root / "coder")]


def test_two_gpus_give_one_gpus_tokens(tiny):
    """Two adapters and a schema in one batch, cold and again from the prefix cache, then a
    prefix evicted to the host tier and loaded back: equal token for token to one GPU."""
    model, folders = tiny
    names = ["poet", "coder"]
    prompts, params = _jobs(names)
    results = {}
    for size in (1, 2):
        llm = LLM(model=model, device="cuda", dtype="float32", tensor_parallel_size=size,
                  num_pages=128, max_loras=2, max_lora_rank=16, max_num_seqs=16,
                  host_kv_pages=64)
        runner = llm.engine.runner
        assert runner.graphs is not None and runner.piecewise is not None
        for name, folder in zip(names, folders, strict=True):
            llm.load_adapter(name, folder)
        first = llm.generate(prompts, params)
        again = llm.generate(prompts, params)
        assert all(o.error is None for o in first + again), [o.error for o in first]
        assert sum(o.num_cached_tokens for o in again) > 0
        if first[-1].finish_reason == "stop":  # a random model may run out of tokens first
            jsonschema.validate(json.loads(first[-1].text), SCHEMA)
        engine, cache = llm.engine, llm.engine.prefix_cache
        engine.reset_prefix_cache()
        long_prompt = llm.tokenizer.encode(PROMPTS[0] * 12)
        cold, _ = run(engine, long_prompt)
        assert cache.make_room(engine.allocator.num_pages)  # every page to the host tier
        warm, cached = run(engine, long_prompt)
        assert cached >= len(long_prompt) - 2 * engine.cfg.page_size
        assert cache.stats().host_hit_tokens == cached and warm == cold
        results[size] = ([o.token_ids for o in first], [o.token_ids for o in again],
                         first[-1].text, cold)
        assert closed_within(llm, 60), f"closing the engine of size {size} hung"
    assert results[2] == results[1]
    by_adapter = results[1][0]
    assert by_adapter[0] != by_adapter[2] or by_adapter[3] != by_adapter[5]  # LoRA is in play


def test_two_gpus_resume_a_session_from_their_page_files(tiny, tmp_path):
    """The disk tier at two ranks: a session's pages written by one pair of ranks, each its
    share, and read back by a restarted pair give the cold run's tokens."""
    kw = dict(model=tiny[0], device="cuda", dtype="float32", tensor_parallel_size=2,
              num_pages=128, host_kv_pages=64, max_loras=0, kv_disk_dir=tmp_path)
    llm = LLM(**kw)
    prompt = llm.tokenizer.encode(PROMPTS[0] * 12)
    reply, _ = run(llm.engine, prompt, session="S")
    turn = prompt + reply + llm.tokenizer.encode(" And then?")
    cold, _ = run(llm.engine, turn, tenant="cold")
    assert closed_within(llm, 60)
    llm = LLM(**kw)
    tokens, cached = run(llm.engine, turn, session="S2")
    assert tokens == cold and cached >= len(prompt) - 16
    assert llm.engine.prefix_cache.stats().disk_hit_tokens >= len(prompt) - 16
    assert closed_within(llm, 60)


def test_a_dead_rank_fails_the_step_on_gpus(tmp_path):
    llm = LLM(model="synthetic:tiny", cache_dir=tmp_path, device="cuda", dtype="bfloat16",
              tensor_parallel_size=2, num_pages=64, max_loras=0)
    _, seconds, error = kill_rank_1_mid_generation(llm, max_tokens=900)
    assert "rank 1" in str(error)
    assert seconds < 30
    assert closed_within(llm, 60)


def test_serve_two_gpus_answers_the_openai_sdk_and_drains(tiny, tmp_path):
    from pathlib import Path

    from openai import OpenAI

    from tests.conftest import serve

    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
               "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    with serve(tmp_path, "--device", "cuda", "--dtype", "bfloat16",
               "--tensor-parallel-size", "2", model=Path(tiny[0])) as server:
        client = OpenAI(base_url=server.base_url, api_key=server.api_key)
        chunks = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8, temperature=0.7, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reply = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=tools, tool_choice="required", max_tokens=40, temperature=0)
        calls = reply.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), weather)
        os.kill(server.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while (ended := os.waitpid(server.pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline, "the server did not drain within 60 s"
            time.sleep(0.2)
        assert os.waitstatus_to_exitcode(ended[1]) == 0, server.log.read_text()[-3000:]
        assert "Traceback" not in server.log.read_text()

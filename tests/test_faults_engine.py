"""Faults inside the engine (issue 9): KV exhaustion (preemption and recompute; session pins
that fill the pool), and one request's failure (NaN logits from a real PEFT adapter, an adapter
file that no longer loads) failing that request alone, with a reason, while the rest of the
batch gives exactly the tokens it gives alone."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.tiny_models import save_peft_adapter, save_tiny

peft = pytest.importorskip("peft")

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A small random Llama (vocab 320) with SmolLM2's tokenizer files: engine steps in ms."""
    base = save_tiny(tmp_path_factory.mktemp("faults") / "tiny", "llama")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / f, base / f)
    return base


def _long_prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 320, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def _run(llm: LLM, prompts, params, max_steps: int = 20_000):
    """`llm.generate` with a bound on engine steps: a stuck request fails the test, not CI."""
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", p, sp)
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert not eng.has_unfinished_requests(), "requests stuck in the engine"
    return [(outs[f"r{i}"], reasons[f"r{i}"]) for i in range(len(prompts))]


def test_kv_exhaustion_preempts_recomputes_and_finishes_everything(tiny_dir: Path) -> None:
    # 10 requests of 60-123 prompt tokens + 48 new ones need 7-11 pages of 16 each (~90 in
    # all); the pool has 24, so requests are preempted and recomputed again and again.
    prompts = _long_prompts(10, 60)
    params = [SamplingParams(max_tokens=48, **GREEDY) for _ in prompts]
    alone = LLM(model=str(tiny_dir), num_pages=64, page_size=16)
    expected = [alone.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params,
                                                                         strict=True)]
    small = LLM(model=str(tiny_dir), num_pages=24, page_size=16, max_num_seqs=10)
    got = _run(small, prompts, params)
    assert [r for _, r in got] == ["length"] * 10
    assert [t for t, _ in got] == expected  # recompute changes nothing
    assert small.engine.scheduler.num_preemptions >= 3
    small.engine.reset_prefix_cache()
    assert small.engine.allocator.num_used == 0


def test_outputs_report_the_time_spent_queued(tiny_dir: Path) -> None:
    """One seat: the second request waits in the queue until the first finishes, and its
    outputs say so (`queue_time`, what /metrics' queue-time histogram observes)."""
    llm = LLM(model=str(tiny_dir), num_pages=64, page_size=16, max_num_seqs=1)
    eng = llm.engine
    prompts = _long_prompts(2, 20)
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", p, SamplingParams(max_tokens=6, **GREEDY))
    added = time.monotonic()
    queued: dict[str, float | None] = {}
    first_done = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            queued.setdefault(out.request_id, out.queue_time)
            if out.request_id == "q0" and out.finished:
                first_done = time.monotonic()
    assert first_done is not None and queued.keys() == {"q0", "q1"}
    q0, q1 = queued["q0"], queued["q1"]
    assert q0 is not None and q1 is not None and 0 <= q0 < q1
    # q1 was scheduled by a step that started after q0's last output was returned.
    assert q1 >= first_done - added


def test_pinned_sessions_never_starve_a_request(tiny_dir: Path) -> None:
    """Session pins are a per-tenant budget, so four tenants may pin the whole pool; a request
    that needs the pool must still run (pins are given up as a last resort), not wait forever."""
    llm = LLM(model=str(tiny_dir), num_pages=25, page_size=16, session_kv_pages=6)
    eng = llm.engine
    for t in range(4):  # each tenant's session pins its 6 full pages: 24 of the 25 in all
        eng.add_request(f"s{t}", _long_prompts(1, 92 + t)[0], SamplingParams(max_tokens=6),
                        tenant=f"t{t}", session_id=f"sess-{t}")
        while eng.has_unfinished_requests():
            eng.step()
    assert eng.prefix_cache.pins.num_pages == 24 and eng.allocator.num_free == 1
    big = _long_prompts(1, 300)[0]
    ((tokens, reason),) = _run(llm, [big], [SamplingParams(max_tokens=60, **GREEDY)],
                               max_steps=500)
    assert reason == "length" and len(tokens) == 60
    assert eng.prefix_cache.pins.num_pages < 24


# -- one failing request fails alone --------------------------------------------------------


def test_a_failing_request_fails_alone(smollm2_dir: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN logits from a real adapter, and an adapter whose file was truncated on disk after it
    was registered: those requests fail with the reason; the others' greedy tokens are the
    ones they get alone. (Grammar faults: tests/test_faults_http.py, on the warm server.)"""
    llm = LLM(model=str(smollm2_dir), max_num_seqs=16, num_pages=128, max_loras=2,
              max_cpu_loras=2)
    broken = save_peft_adapter(smollm2_dir, tmp_path / "broken", seed=1)
    llm.load_adapter("broken", broken)  # registered while healthy, then evicted from memory
    # Weights of 1e30 are refused where they enter (tests/test_adapter_weights.py); registered
    # past that check (as before it existed), they make NaN logits: the step's last guard.
    with monkeypatch.context() as m:
        m.setattr("lora.adapter.check_gain", lambda *a: None)
        llm.load_adapter("nan", save_peft_adapter(smollm2_dir, tmp_path / "nan", seed=2,
                                                  fill=1e30))
    llm.load_adapter("good", save_peft_adapter(smollm2_dir, tmp_path / "good", seed=3))
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # the disk copy is now truncated

    healthy = [
        ("The capital of France is", SamplingParams(max_tokens=8, **GREEDY)),
        ("def fibonacci(n):", SamplingParams(max_tokens=8, **GREEDY)),
        ("Once upon a time", SamplingParams(max_tokens=8, adapter="good", **GREEDY)),
    ]
    failing = [
        ("Hello", SamplingParams(max_tokens=8, adapter="nan", **GREEDY), "non-finite logits"),
        ("Hi", SamplingParams(max_tokens=8, adapter="broken", **GREEDY),
         "adapter 'broken' can no longer be loaded"),
    ]
    alone = [llm.generate(p, sp)[0] for p, sp in healthy]
    mixed = [failing[0], *healthy[:2], failing[1], healthy[2]]
    outs = llm.generate([p for p, *_ in mixed], [sp for _, sp, *_ in mixed])
    got = {id(sp): out for (_, sp, *_), out in zip(mixed, outs, strict=True)}
    for (_, sp), ref in zip(healthy, alone, strict=True):
        out = got[id(sp)]
        assert (out.token_ids, out.finish_reason, out.error) == (ref.token_ids, "length", None)
    for _, sp, why in failing:
        out = got[id(sp)]
        assert out.finish_reason == "error" and why in out.error, out.error
        assert out.token_ids == []
    llm.engine.reset_prefix_cache()
    assert llm.engine.allocator.num_used == 0


def test_decode_attention_never_reads_past_a_rows_context() -> None:
    """A freed page keeps its last owner's KV (NaN, from a NaN adapter); a row whose context
    ends inside that page, or is padded to a longer row's width, must not see it (0 * NaN)."""
    from kernels.paged_attention import paged_decode_torch

    page, kvh, dim = 4, 2, 8
    k = torch.full((6 * page, kvh, dim), float("nan"))
    v = k.clone()
    tables = torch.tensor([[3, 5, 0], [1, 2, 4]], dtype=torch.int32)  # row 0 padded with page 0
    lens = torch.tensor([5, 11], dtype=torch.int32)  # both end inside their last page
    for row, n in enumerate(lens.tolist()):
        slots = [int(tables[row, j // page]) * page + j % page for j in range(n)]
        k[slots], v[slots] = torch.randn(n, kvh, dim), torch.randn(n, kvh, dim)
    q = torch.randn(2, 4, dim)
    out = torch.empty_like(q)
    paged_decode_torch(q, k, v, tables, lens, page, dim**-0.5, out)
    clean = torch.empty_like(q)
    paged_decode_torch(q, k.nan_to_num(0.0), v.nan_to_num(0.0), tables, lens, page, dim**-0.5,
                       clean)
    assert torch.isfinite(out).all() and torch.equal(out, clean)

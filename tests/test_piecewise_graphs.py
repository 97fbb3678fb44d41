"""The piecewise forward (engine/runner/piecewise_graphs.py) computes the model's forward: its
pieces,
run without capture on the CPU, over padded static buffers with each layer's attention between
them (and LoRA rows through the static segment table), give the eager engine's logits and
tokens step for step (CUDA replays them: tests/test_gpu_engine.py)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.piecewise_graphs import PiecewiseGraphs, piecewise_sizes
from tests.tiny_models import save_peft_adapter, save_tiny, save_word_tokenizer


def test_sizes_pad_little():
    sizes = piecewise_sizes(2048)
    assert sizes[0] == 128 and sizes[-1] == 2048
    steps = zip(sizes, sizes[1:], strict=False)
    assert all(b - a == (32 if a < 1024 else 64) for a, b in steps)
    assert piecewise_sizes(200) == [128, 160, 192, 200]
    assert piecewise_sizes(1100)[-3:] == [1024, 1088, 1100]


def _record_logits(llm: LLM) -> list[torch.Tensor]:
    runner, seen = llm.engine.runner, []
    forward = runner.forward

    def recorded(inputs, input_ids=None):
        logits = forward(inputs, input_ids)
        seen.append(logits.clone())
        return logits

    runner.forward = recorded
    return seen


@pytest.mark.parametrize("kind", ["llama", "qwen3", "llama+lora"])
def test_pieces_give_the_forwards_logits(tmp_path, monkeypatch, kind):
    from engine.runner import piecewise_graphs

    monkeypatch.setattr(piecewise_graphs, "SEGMENT_ROWS", 16)  # steps of 48 rows cut runs
    base = save_tiny(tmp_path / "base", kind.removesuffix("+lora"), num_hidden_layers=2)
    save_word_tokenizer(base)
    adapters = ["a", "b"] if kind.endswith("+lora") else []
    for i, name in enumerate(adapters):
        save_peft_adapter(base, tmp_path / name, seed=i)
    gen = torch.Generator().manual_seed(1)
    # Lengths past the step budget (chunked prefill), prompts beside decodes: mixed steps;
    # with adapters, steps mix their rows and base rows, their runs cut at 16 rows.
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (5, 70, 23, 41, 9)]
    which = [None, "a", None, "b", "a"] if adapters else [None] * len(prompts)
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, adapter=a)
              for a in which]

    runs = []
    for piecewise in (False, True):
        llm = LLM(model=str(base), max_num_seqs=3, num_pages=64, max_num_batched_tokens=48)
        for name in adapters:
            llm.load_adapter(name, tmp_path / name)
        runner = llm.engine.runner
        used: list[bool] = []
        if piecewise:
            pw = PiecewiseGraphs(llm.engine.model, runner.kv_caches,
                                 runner.pad_page * runner.page_size, 48, 3, runner.lora)
            pw.sizes = [16, 32, 48]  # pad every step, the shortest too
            run = pw.run
            pw.run = lambda ids, *a, run=run, used=used: used.append(a[-1] is not None) or run(
                ids, *a)
            runner.piecewise = pw
        logits = _record_logits(llm)
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        runs.append((tokens, logits, used))

    (eager_tokens, eager_logits, _), (pw_tokens, pw_logits, used) = runs
    assert used and any(used) == bool(adapters), "no piecewise step ran (with LoRA rows)"
    assert pw_tokens == eager_tokens
    assert len(pw_logits) == len(eager_logits)
    for a, b in zip(pw_logits, eager_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_lora_segments_fit_the_capacity(tmp_path):
    """The worst case: every sequence alone in its adapter, each cut at `SEGMENT_ROWS`."""
    from engine.runner.piecewise_graphs import SEGMENT_ROWS
    from kernels.seg_lora import segment_table

    base = save_tiny(tmp_path / "base", "llama", num_hidden_layers=1)
    save_word_tokenizer(base)
    llm = LLM(model=str(base), max_num_seqs=5, num_pages=16)
    runner = llm.engine.runner
    pw = PiecewiseGraphs(llm.engine.model, runner.kv_caches, 0, 128, 5, runner.lora)
    for b in pw.sizes:  # 5 sequences, adapters 0, 1, 0, 1, 0
        for lengths in ([b - 4, 1, 1, 1, 1], [b // 5] * 4 + [b - 4 * (b // 5)]):
            slots = [i % 2 for i, n in enumerate(lengths) for _ in range(n)]
            indptr, _ = segment_table(slots, pw.segment_capacity(b), SEGMENT_ROWS)
            assert indptr[-1] == b

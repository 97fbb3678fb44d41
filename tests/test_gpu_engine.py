"""The engine on CUDA gives the CPU torch path's greedy tokens: a small random-weight Llama
(and LoRA adapters on it), eager and with CUDA graphs; bf16 graphs give bf16 eager's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny, save_word_tokenizer

pytestmark = pytest.mark.gpu
VOCAB = 320
ADAPTERS = {  # name -> peft LoraConfig kwargs
    "all8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"]),
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    import peft
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gpu-engine")
    base = save_tiny(root / "base", "llama", num_hidden_layers=2, max_position_embeddings=256)
    save_word_tokenizer(base)
    adapters = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, **kw))
        model.save_pretrained(root / name)
        adapters[name] = root / name
    return base, adapters


def generate(base: Path, adapters: dict[str, Path], requests: list[str | None],
             max_tokens: list[int] | None = None, **engine_args):
    from engine import LLM, SamplingParams

    engine_args.setdefault("dtype", "float32")  # compared with the CPU's and peft's
    llm = LLM(model=str(base), max_num_seqs=8, num_pages=64, page_size=16, **engine_args)
    for name, path in adapters.items():
        llm.load_adapter(name, path)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 60, (len(requests),), generator=gen).tolist()
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    max_tokens = max_tokens or [12] * len(requests)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, adapter=a)
              for a, m in zip(requests, max_tokens, strict=True)]
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    graphs = llm.engine.runner.graphs
    return outs, graphs


REQUESTS = [None, "all8", None, "qv4", "all8", None]


@pytest.mark.parametrize("lora_kernel", ["segmented", "bgmv"])
def test_cuda_matches_cpu(tiny, monkeypatch, lora_kernel):
    """Eager and graphed decodes give the CPU path's tokens; the graphs replay each LoRA
    kernel (BGMV: as if the step had more segments than segmented LoRA takes)."""
    import lora.batch

    if lora_kernel == "bgmv":
        monkeypatch.setattr(lora.batch, "SEGMENTED_MAX_SEGMENTS", 0)
    base, adapters = tiny
    cpu, _ = generate(base, adapters, REQUESTS, device="cpu")
    eager, graphs = generate(base, adapters, REQUESTS, device="cuda", cuda_graphs=False)
    assert graphs is None
    assert eager == cpu
    graphed, graphs = generate(base, adapters, REQUESTS, device="cuda")
    assert graphs is not None and graphs.last_key[1] == lora_kernel
    assert graphed == cpu


def test_bf16_graphs_match_eager(tiny):
    """Eight base-model requests: the graph of size 8 runs the same kernels on the same shapes
    as the eager steps (with adapters, eager decodes take SGMV or BGMV where graphs take
    `kernels.seg_lora`)."""
    base, _ = tiny
    requests = [None] * 8
    eager, _ = generate(base, {}, requests, device="cuda", dtype="bfloat16", cuda_graphs=False)
    graphed, graphs = generate(base, {}, requests, device="cuda", dtype="bfloat16")
    assert graphs is not None and graphed == eager


def test_extend_graphs_match_cpu(tiny):
    """Requests run one at a time, so each prompt is a chunk alone in its step and replays an
    extend graph (padded to 16, 32 or 64 tokens); the later prompts extend the earlier ones,
    so their chunks attend to cached context too. Tokens equal the CPU path's."""
    from engine import LLM, SamplingParams

    base, adapters = tiny
    gen = torch.Generator().manual_seed(1)
    first = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 40, 70)]
    prompts = first + [p + torch.randint(0, VOCAB, (9,), generator=gen).tolist() for p in first]
    requests = [None, "all8", None, None, "all8", None]
    outs, replays = {}, []
    for device in ("cpu", "cuda"):
        llm = LLM(model=str(base), max_num_seqs=8, num_pages=64, page_size=16, device=device,
                  dtype="float32")
        for name, path in adapters.items():
            llm.load_adapter(name, path)
        if device == "cuda":  # count the chunks that replayed a graph
            graphs = llm.engine.runner.extend_graphs
            graphs.run = lambda *a, run=graphs.run: replays.append(len(a[0].input_ids)) or run(*a)
        outs[device] = [
            llm.generate([p], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                             adapter=a))[0].token_ids
            for p, a in zip(prompts, requests, strict=True)
        ]
    assert outs["cuda"] == outs["cpu"]
    assert len(replays) == len(prompts) and max(replays) > 16, replays


def test_piecewise_graphs_match_cpu(tiny):
    """More prompts than seats and a small step budget: prompts are prefilled in chunks beside
    decodes, so mixed steps replay the piecewise graphs (padded to their sizes), base-only and
    with adapters' rows (the segmented LoRA pieces). Tokens equal the CPU path's, in fp32 and
    with the host KV tier's fenced layers, as with the pieces turned off."""
    from engine import LLM, SamplingParams

    base, adapters = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist()
               for n in (5, 70, 23, 41, 9, 33, 60, 12)]
    requests = [None, None, None, "all8", None, "qv4", None, None]

    def run(**engine_args):
        llm = LLM(model=str(base), max_num_seqs=4, num_pages=64, page_size=16,
                  max_num_batched_tokens=48, dtype="float32", **engine_args)
        for name, path in adapters.items():
            llm.load_adapter(name, path)
        replays: list[tuple[int, bool]] = []  # (tokens, with LoRA rows) of each replay
        pw = llm.engine.runner.piecewise
        if pw is not None:
            pw.run = lambda ids, *a, run=pw.run: replays.append(
                (len(ids), a[-1] is not None)) or run(ids, *a)
        params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, adapter=a)
                  for a in requests]
        return [o.token_ids for o in llm.generate(prompts, params)], replays

    cpu, _ = run(device="cpu")
    for extra in ({}, {"host_kv_gb": 0.01}):
        cuda, replays = run(device="cuda", **extra)
        assert cuda == cpu, extra
        assert {lora for _, lora in replays} == {False, True}, replays
        assert max(n for n, _ in replays) > 1, replays
    eager, replays = run(device="cuda", piecewise_graphs=False)
    assert eager == cpu and not replays


def test_graphs_follow_a_changing_batch(tiny):
    """More requests than seats, each with its own length: between graph steps the batch
    shrinks, refills and reorders (a row's pages change request), page tables grow, and the
    graph size changes; the tokens stay the CPU path's."""
    base, adapters = tiny
    requests = [None, "all8", None, "qv4"] * 4
    lengths = [3 + (7 * i) % 29 for i in range(len(requests))]
    cpu, _ = generate(base, adapters, requests, lengths, device="cpu")
    graphed, graphs = generate(base, adapters, requests, lengths, device="cuda")
    assert graphs is not None and graphed == cpu


def _speculating_engine(base: Path, adapters: dict[str, Path], device: str):
    """An engine built to speculate (its verify graphs captured on CUDA), the adapters loaded."""
    from engine import LLM

    llm = LLM(model=str(base), max_num_seqs=8, num_pages=64, page_size=16, device=device,
              dtype="float32", num_speculative_tokens=4)
    for name, path in adapters.items():
        llm.load_adapter(name, path)
    return llm


class EchoDrafter:
    """Proposes the sequence's last few tokens again: a draft at every decode, of lengths 1..k
    (rarely accepted by random weights; the verify step's cost and layout are what count)."""

    def propose(self, tokens: list[int], k: int, namespace: object = None) -> list[int]:
        return tokens[-(1 + len(tokens) % k):]


def test_verify_graphs_match_cpu(tiny):
    """Speculative steps of several sequences (drafts of several lengths, plain decodes beside
    them, two adapters and the base model) replay the verify graphs; the tokens equal the CPU
    path's."""
    from engine import SamplingParams
    from engine.spec.speculative import Speculator

    base, adapters = tiny
    requests = [None, "all8", None, "qv4", "all8"]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 30, 9, 44)]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, adapter=a)
              for a in requests]
    outs, replays = {}, []
    for device in ("cpu", "cuda"):
        llm = _speculating_engine(base, adapters, device)
        llm.engine.speculator = Speculator(4, EchoDrafter())
        if device == "cuda":
            graphs = llm.engine.runner.verify_graphs
            graphs.run = lambda inputs, run=graphs.run: replays.append(len(inputs.tables)) or \
                run(inputs)
        outs[device] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["cuda"] == outs["cpu"]
    assert replays and max(replays) == len(prompts), replays


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_loop_matches_cpu(tiny, method, monkeypatch):
    """The overlapped speculative loop (engine/spec/loop.py) on CUDA: drafts looked up on the
    device, its steps replaying the verify graphs over inputs built on the device
    (`VerifyGraphs.run_fed`), two adapters and the base model, sequences leaving as they end.
    Every step verifies (min_acceptance 0). The tokens equal the CPU engine's loop, which runs
    the same steps eagerly, and plain decoding's. Suffix decoding runs the requests twice, the
    second time drafting from the first's outputs through the host's hints (kept on: this
    small model's host never waits, and `HintGate` would turn them off)."""
    from engine import SamplingParams
    from engine.spec.loop import HintGate
    from engine.spec.speculative import PromptLookup, Speculator
    from engine.spec.suffix import SuffixDrafter

    monkeypatch.setattr(HintGate, "update", lambda self, waited, cost: None)

    base, adapters = tiny
    requests = [None, "all8", None, "qv4", "all8"]
    gen = torch.Generator().manual_seed(3)
    prompts = [(torch.randint(0, VOCAB, (n,), generator=gen).tolist() * 3)[: 3 * n]
               for n in (4, 9, 15, 6, 20)]  # repeats: the lookup finds matches
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, adapter=a)
              for a, m in zip(requests, (14, 9, 20, 12, 16), strict=True)]
    outs, fed = {}, []
    for device in ("cpu", "cuda"):
        llm = _speculating_engine(base, adapters, device)
        eng = llm.engine
        outs[f"{device} plain"] = [o.token_ids for o in llm.generate(prompts, params)]
        drafter = SuffixDrafter() if method == "suffix" else PromptLookup()
        eng.speculator = Speculator(4, drafter, min_acceptance=0.0)
        eng.overlap = True
        if device == "cuda":
            graphs = eng.runner.verify_graphs
            graphs.run_fed = lambda f, run=graphs.run_fed: fed.append(len(f.lora_slots)) or \
                run(f)
        outs[device] = [o.token_ids for o in llm.generate(prompts, params)]
        if method == "suffix":
            eng.reset_prefix_cache()
            assert [o.token_ids for o in llm.generate(prompts, params)] == outs[device]
        assert eng.speculator.stats.forwards >= 2 * len(prompts)
    assert outs["cuda"] == outs["cpu"] == outs["cpu plain"] == outs["cuda plain"]
    assert fed and max(fed) == len(prompts) and min(fed) < len(prompts), fed

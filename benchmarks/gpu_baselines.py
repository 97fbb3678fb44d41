"""The GPU suite's baseline worker: the engine against transformers' `generate` (static
batches of 64, padded) and against peft's mixed-adapter batch, same weights, same GPU.

Run by benchmarks/gpu_suite.py; it appends one JSON line per section to --out.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from gpu_common import Recorder, decode_round, greedy, random_prompts, write_adapter
from hf_twin import transformers_twin
from transformers import StoppingCriteria, StoppingCriteriaList

from engine import LLM

RANK = 16
PAD = 2  # the SmolLM2 tokenizer's <|im_end|>, also its eos


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=170.0, help="seconds for the whole worker")
    ap.add_argument("--adapter-dir", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=128, help="mixed workload size")
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=192)
    ap.add_argument("--peft-steps", type=int, default=16)
    args = ap.parse_args()
    rec = Recorder(args.out, args.budget)

    with rec.section("baseline_setup", 60) as s:
        t = time.monotonic()
        seq_pages = -(-(args.max_prompt + args.max_output + 16) // 16)
        llm = LLM(args.model, dtype="bfloat16", device="cuda", max_num_seqs=args.requests,
                  max_num_batched_tokens=16384, num_pages=args.requests * seq_pages + 256,
                  max_loras=8, max_cpu_loras=8, max_lora_rank=RANK)
        hf = transformers_twin(llm)
        torch.cuda.synchronize()
        s.result["load_s"] = round(time.monotonic() - t, 1)
    vocab = llm.engine.model_config.vocab_size

    with rec.section("vs_peft", 60) as s:
        import peft

        files = [args.adapter_dir / f"f{k}" for k in range(8)]
        for k, f in enumerate(files):
            write_adapter(f, llm.engine.model_config, RANK, seed=k, device="cuda")
            llm.load_adapter(f"a{k}", f)
        prompts = random_prompts(64, 1024, seed=1, vocab=vocab)
        names = [f"a{i % 8}" for i in range(64)]
        ours = decode_round(llm, prompts, lambda i, n: greedy(n, names[i]), args.peft_steps)
        pm = peft.PeftModel.from_pretrained(hf, files[0], adapter_name="a0").eval()
        try:
            for k in range(1, 8):
                pm.load_adapter(files[k], adapter_name=f"a{k}")
            ids, mask = left_pad(prompts, hf.device)
            clock = StepClock()
            with torch.inference_mode():
                pm.generate(input_ids=ids, attention_mask=mask, adapter_names=names,
                            max_new_tokens=args.peft_steps, min_new_tokens=args.peft_steps,
                            do_sample=False, pad_token_id=PAD,
                            stopping_criteria=StoppingCriteriaList([clock]))
        finally:
            hf = pm.unload()  # the plain twin again, for the next section
        peft_tok_s = 64 * (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])
        s.result.update(batch="64 prompts of 1024 tokens, 8 rank-16 adapters round-robin, "
                              f"{args.peft_steps} decode steps; decode steps timed on both sides",
                        peft_version=peft.__version__, peft_tok_s=round(peft_tok_s, 1),
                        ours_tok_s=round(ours.tok_s, 1),
                        lora_vs_peft_b64=round(ours.tok_s / peft_tok_s, 2))

    with rec.section("vs_transformers", 130) as s:
        rng = random.Random(0)
        shape = [(rng.randint(64, args.max_prompt), rng.randint(32, args.max_output))
                 for _ in range(args.requests)]
        prompts = random_prompts(len(shape), [p for p, _ in shape], seed=2, vocab=vocab)
        reqs = list(zip(prompts, [o for _, o in shape], strict=True))
        assert not any("lora" in name for name, _ in hf.named_modules())
        hf_generate(hf, reqs[:2], 2)  # warm-up both
        llm.generate([p for p, _ in reqs[:4]], [greedy(o) for _, o in reqs[:4]])
        done, t_hf = [], 0.0
        for i in range(0, len(reqs), 64):  # static batches; stop early if out of time
            if done and s.left() < 1.8 * t_hf / len(done) * 64:  # its batch + ours on all
                s.notes.append(f"transformers ran {len(done)} of {len(reqs)} requests in time; "
                               "both sides measured on those")
                break
            t_hf += hf_generate(hf, reqs[i : i + 64], 64)
            done += reqs[i : i + 64]
        t = time.perf_counter()
        outs = llm.generate([p for p, _ in done], [greedy(o) for _, o in done])
        t_ours = time.perf_counter() - t
        assert [len(o.token_ids) for o in outs] == [o for _, o in done]
        useful = sum(o for _, o in done)
        s.result.update(
            workload=f"{len(done)} requests, prompts 64-{args.max_prompt} tokens, outputs "
                     f"32-{args.max_output} tokens (uniform), {useful} useful output tokens",
            transformers_tok_s=round(useful / t_hf, 1), ours_tok_s=round(useful / t_ours, 1),
            vs_transformers=round(t_hf / t_ours, 2))

def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def hf_generate(hf, reqs: list[tuple[list[int], int]], batch: int) -> float:
    """Seconds for transformers' generate over `reqs` in static batches of `batch`: each batch
    is padded to its longest prompt and runs until its longest output is done."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        ids, mask = left_pad([p for p, _ in chunk], hf.device)
        new = max(o for _, o in chunk)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                        min_new_tokens=new, do_sample=False, pad_token_id=PAD)
    torch.cuda.synchronize()
    return time.perf_counter() - t


class StepClock(StoppingCriteria):
    """Stops nothing; records when each generated token is ready (decode steps timed apart
    from the prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


if __name__ == "__main__":
    main()

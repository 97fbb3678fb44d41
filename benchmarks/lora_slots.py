"""More adapters wanted than device slots (issue #37's `lora_more_than_slots_vs_base`):
`python benchmarks/lora_slots.py --out sections.jsonl` (a `gpu_suite` part, `--parts lora_slots`).

256 requests (prompts of 512 tokens, 128 output tokens each) over 64 rank-16 adapters on all 7
projections, queued at once through the offline engine with 16 adapter slots: the adapters are
interleaved (request i takes adapter i mod 64), the worst order for slots. Output tokens/s ÷
the same requests on the base model, rounds interleaved, the best of each. The adapters stay
in the host cache; what the ratio measures is admission (a request whose adapter has no slot
waits, ADAPTER_WAIT_S bounds how long) and the slot loads between steps.

`--small` runs it at toy sizes (8 adapters through 2 slots) on any device: a check of the
script, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
from gpu_common import Recorder, random_prompts, timed_generate, write_adapter

from engine import LLM, SamplingParams


def run(model: str | None, adapter_dir: Path, device: str, requests: int, adapters: int,
        slots: int, prompt_len: int, output_len: int, rounds: int) -> dict:
    llm = LLM(model, device=device, max_loras=slots, max_cpu_loras=adapters,
              max_lora_rank=16)
    cfg = llm.engine.model_config
    files = [adapter_dir / f"s{k}" for k in range(min(adapters, 16))]
    for k, folder in enumerate(files):  # names share 16 files: each name is its own adapter
        write_adapter(folder, cfg, 16, seed=k, device=device)
    for k in range(adapters):
        llm.load_adapter(f"t{k}", files[k % len(files)])
    prompts = random_prompts(requests, prompt_len, seed=5, vocab=cfg.vocab_size)

    def tok_s(llm: LLM, lora: bool) -> float:
        params = [SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True,
                                 adapter=f"t{i % adapters}" if lora else None)
                  for i in range(requests)]
        outs, seconds = timed_generate(llm, prompts, params, device)
        return sum(len(o.token_ids) for o in outs) / seconds

    runs: dict[str, list[float]] = {"base": [], "lora": []}
    for _ in range(rounds):
        runs["base"].append(round(tok_s(llm, False), 1))
        runs["lora"].append(round(tok_s(llm, True), 1))
    stats = llm.engine.adapters.stats
    res = {"output_tok_s": runs, "requests": requests, "adapters": adapters, "slots": slots,
           "prompt_len": prompt_len, "output_len": output_len,
           "device_loads": stats.loads["device"], "device_evictions": stats.evictions["device"],
           "lora_more_than_slots_vs_base": round(max(runs["lora"]) / max(runs["base"]), 3)}
    del llm
    gc.collect()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, one per section")
    ap.add_argument("--adapter-dir", type=Path, default=Path("/tmp/lora_slots"))
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole worker")
    ap.add_argument("--small", action="store_true", help="toy sizes: a check of the script")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    rec = Recorder(args.out, args.budget)
    with rec.section("lora_slots", args.budget) as s:
        sizes = ((8, 8, 2, 16, 4, 1) if args.small else (256, 64, 16, 512, 128, 2))
        requests, adapters, slots, prompt_len, output_len, rounds = sizes
        s.result.update(run(args.model or None, args.adapter_dir / "slots", args.device,
                            requests, adapters, slots, prompt_len, output_len, rounds))
        print(json.dumps(s.result), flush=True)


if __name__ == "__main__":
    main()

"""Upload a LoRA adapter to a running Switchboard server and chat with it (openai SDK).

    make serve                                                  # in another terminal
    python examples/multi_tenant_lora.py --adapter path/to/peft-folder --name support-bot
    python examples/multi_tenant_lora.py      # no folder: makes a small random demo adapter

The upload is plain HTTP (httpx): POST /v1/adapters as multipart, field `name` plus the
folder's files as repeated `files` parts. Chat then selects the adapter by `model`, either its
name or `base:name`. Adapters belong to the API key's tenant: other tenants cannot see or use
them. --keep leaves the adapter registered; by default the script deletes it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import httpx
from openai import OpenAI

FILES = ("adapter_config.json", "adapter_model.safetensors")


def upload(base_url: str, api_key: str, name: str, folder: Path) -> dict:
    """POST the PEFT folder's two files; returns the adapter object (raises on 4xx/5xx)."""
    files = [("files", (f, (folder / f).read_bytes())) for f in FILES]
    r = httpx.post(f"{base_url}/adapters", data={"name": name}, files=files,
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=120)
    if r.status_code != 200:
        raise SystemExit(f"upload failed ({r.status_code}): {r.json()['error']['message']}")
    return r.json()


def make_demo_adapter(folder: Path, seed: int = 0) -> Path:
    """A random rank-8 LoRA on q_proj/v_proj for the embedded SmolLM2-135M (for trying the API
    without training one; real adapters come from peft's `save_pretrained`)."""
    import numpy as np
    from safetensors.numpy import save_file

    hidden, kv, layers, r = 576, 192, 30, 8
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(layers):
        for proj, out in (("q_proj", hidden), ("v_proj", kv)):
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            a = rng.standard_normal((r, hidden)) / hidden**0.5
            tensors[f"{key}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out, r)) * 0.05).astype(
                np.float32
            )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 16,
              "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL",
                                                         "http://127.0.0.1:8000/v1"))
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "sk-no-key"))
    ap.add_argument("--adapter", type=Path, help="PEFT adapter folder (default: a demo one)")
    ap.add_argument("--name", default="demo-adapter")
    ap.add_argument("--message", default="Write a one-line greeting for a support chat.")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--keep", action="store_true", help="leave the adapter registered")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.adapter or make_demo_adapter(Path(tmp) / args.name)
        adapter = upload(args.base_url, args.api_key, args.name, folder)
    print(f"uploaded {adapter['id']} (rank {adapter['rank']}, "
          f"{', '.join(adapter['target_modules'])}) on {adapter['parent']}")

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    listed = [(m.id, getattr(m, "parent", None)) for m in client.models.list()]
    print("models:", ", ".join(f"{i} (parent {p})" if p else i for i, p in listed))
    base = adapter["parent"]
    for model in (base, args.name):  # the base model, then the same prompt with the adapter
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": args.message}],
            max_tokens=args.max_tokens, temperature=0,
        )
        print(f"[{model}] {reply.choices[0].message.content}")

    if not args.keep:
        httpx.delete(f"{args.base_url}/adapters/{args.name}",
                     headers={"Authorization": f"Bearer {args.api_key}"}).raise_for_status()
        print(f"deleted {args.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

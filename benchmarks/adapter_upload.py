"""How fast adapters upload through `POST /v1/adapters` (issue #37: tenants upload hundreds to
thousands of PEFT adapters, and a Llama-3-8B rank-64 adapter on all projections is 335 MB in
bf16): seconds and MB/s per upload through HTTP, and the server-side validation's parts
timed in this process on the same files.

    python benchmarks/adapter_upload.py [--model synthetic:llama3-1b] [--ranks 16 64]
        [--count 3] [--file-dtype bfloat16] [--out results.md]

Each adapter is a random PEFT LoRA on all 7 projections (`lora_zipf_http.write_adapter`'s
layout), saved in `--file-dtype`; uploads run one after another, the first of each rank
untimed (a warm-up). The client is curl where it is installed (a Python client's own time is
about as long as the server's: httpx sent 90 MB in 1.7 s where curl took 1.0 s), else httpx.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import Server  # noqa: E402
from lora_zipf_http import ALL, write_adapter  # noqa: E402
from machine import describe  # noqa: E402

from engine.config import ModelConfig, default_cache_dir  # noqa: E402
from engine.runner.loader import resolve_model_dir  # noqa: E402
from lora.adapter import load_adapter  # noqa: E402
from lora.manager import content_uid  # noqa: E402

CURL = shutil.which("curl")


def make(folder: Path, base: ModelConfig, rank: int, seed: int, dtype: torch.dtype) -> float:
    """Write the adapter; its size in MB."""
    write_adapter(folder, base, rank, ALL, seed)
    weights = folder / "adapter_model.safetensors"  # written in float16: re-saved in `dtype`
    save_file({k: v.to(dtype) for k, v in load_file(weights).items()}, str(weights))
    return sum(p.stat().st_size for p in folder.iterdir()) / 1e6


def upload(srv: Server, name: str, folder: Path) -> None:
    if CURL is None:
        srv.upload(name, folder)
        return
    form = [a for p in sorted(folder.iterdir()) for a in ("-F", f"files=@{p}")]
    code = subprocess.run([CURL, "-s", "-o", "/dev/null", "-w", "%{http_code}", "-F",
                           f"name={name}", *form, srv.url + "/v1/adapters"],
                          capture_output=True, text=True, check=True).stdout
    assert code == "200", f"upload of {name}: HTTP {code}"


def parts(folder: Path, base: ModelConfig, rank: int) -> dict[str, float]:
    """The server's validation of one folder, in this process: seconds each part."""
    t = time.perf_counter()
    load_adapter(folder, base, max_rank=rank, dtype=torch.bfloat16)
    t1 = time.perf_counter()
    content_uid(folder)
    return {"load_and_validate_s": t1 - t, "content_hash_s": time.perf_counter() - t1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-1b")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--count", type=int, default=3, help="uploads per rank, one untimed")
    ap.add_argument("--file-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--flags", default="", help="more `switchboard serve` flags")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dtype = getattr(torch, args.file_dtype)
    base = ModelConfig.from_dir(resolve_model_dir(args.model, default_cache_dir()))
    tmp = Path(tempfile.mkdtemp(prefix="adapter-upload-"))
    folders = {(r, k): tmp / f"r{r}-{k}" for r in args.ranks for k in range(args.count)}
    sizes = {key: make(f, base, key[0], hash(key) % 1000, dtype) for key, f in folders.items()}
    flags = ["--model", args.model, "--adapter-dir", str(tmp / "store"), "--max-lora-rank",
             str(max(args.ranks)), "--max-adapter-bytes", str(4 << 30),
             "--max-adapters-per-tenant", str(len(folders)), *args.flags.split()]
    rows = []
    with Server(flags) as srv:
        for rank in args.ranks:
            seconds = []
            for k in range(args.count):
                t = time.perf_counter()
                upload(srv, f"r{rank}-{k}", folders[(rank, k)])
                if k:
                    seconds.append(time.perf_counter() - t)
            mb = sizes[(rank, 0)]
            here = parts(folders[(rank, 0)], base, rank)
            rows.append((rank, mb, statistics.median(seconds), here))
            print(rank, round(mb, 1), "MB", [round(s, 3) for s in seconds], here, flush=True)
    lines = [f"# Adapter uploads through HTTP ({describe()})", "",
             f"`benchmarks/adapter_upload.py --model {args.model} --ranks "
             f"{' '.join(map(str, args.ranks))} --count {args.count} --file-dtype "
             f"{args.file_dtype}`: all 7 projections; medians of the timed uploads; client "
             f"{'curl' if CURL else 'httpx'}.", "",
             "| rank | MB | upload s | MB/s | load and validate s | content hash s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for rank, mb, s, here in rows:
        lines.append(f"| {rank} | {mb:.1f} | {s:.3f} | {mb / s:.0f} | "
                     f"{here['load_and_validate_s']:.3f} | {here['content_hash_s']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

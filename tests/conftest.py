"""Shared fixtures: the embedded SmolLM2 (engine tests) and `gateway_server`, one real
`switchboard serve` for the whole session (gateway tests)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

# Triton kernels run exactly (and slowly) on CPU in interpreter mode; set before any import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist, each worker's torch takes its share of the cores: with every worker's
# OpenMP threads on every core, threads spinning against the other workers (and the servers
# the tests start) made in-process engine tests up to 5x slower than alone.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

ROOT = Path(__file__).resolve().parents[1]

# key -> tenant; beta may run one request at a time, gamma 40 tokens a minute; ops reads
# /metrics (an admin key).
API_KEYS = {
    "sk-test-alpha": "alpha",
    "sk-test-beta": {"tenant": "beta", "max_concurrent_requests": 1},
    "sk-test-gamma": {"tenant": "gamma", "tokens_per_minute": 40},
    "sk-test-ops": {"tenant": "ops", "admin": True},
}
ADMIN_KEY = "sk-test-ops"
# Small and fast: 8 seats + 12 queued sequences (so 16 concurrent requests fit, 40 do not).
SERVE_FLAGS = ["--kv-pages", "160", "--page-size", "16", "--max-num-seqs", "8",
               "--max-queue", "12", "--max-num-batched-tokens", "256", "--log-level", "warning"]
MAX_ADAPTER_BYTES = 8 * 2**20  # gateway_server's upload limit


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# -- the embedded model, loaded once per session ------------------------------------------


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2 as an HF folder (converted from its GGUF once, then cached). The
    offline GPU machine does not install it (`make gpu-install`): its tests skip there; here,
    where `make test` installs it, a missing model is an error."""
    from engine.config import ModelLoadError, default_cache_dir
    from engine.runner.loader import embedded_gguf_path, resolve_model_dir

    if torch.cuda.is_available():
        try:
            embedded_gguf_path()
        except ModelLoadError as e:
            pytest.skip(f"no embedded model on this GPU machine: {e}")
    return resolve_model_dir(None, default_cache_dir())


@pytest.fixture(scope="session")
def smollm2(smollm2_dir: Path):
    from engine import LLM

    return LLM(model=str(smollm2_dir), max_num_seqs=32, num_pages=512)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


# -- the gateway ------------------------------------------------------------------------

# One torch thread: on a small shared machine, OpenMP threads spinning against other processes
# made engine steps several times slower than one thread.
THREADS = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


@dataclass
class GatewayServer:
    url: str  # e.g. http://127.0.0.1:41234
    api_key: str
    model: str
    log: Path
    adapter_dir: Path  # the adapter store (uploads)
    pid: int = 0  # the serve process's

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.url)


def busy_pages(m: dict[str, float]) -> float:
    """KV pages held by requests, from a /metrics reading: the used pages but those sessions
    (and stored Responses, which are sessions) pin between turns by design. Pins are counted
    per session, so forks sharing pages make this negative: compare with `<= 0`."""
    return m["switchboard_kv_pages_used"] - m.get("switchboard_session_pinned_pages", 0)


def read_metrics(url: str) -> dict[str, float]:
    """A server's /metrics as {series (name with labels): value} (read with `ADMIN_KEY`,
    which servers without it must serve --public-metrics or without keys)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    lines = httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines
            if ln and not ln.startswith("#")}


@contextmanager
def serve(tmp: Path, *flags: str, model: Path | None = None) -> Iterator[GatewayServer]:
    """`switchboard serve` in a subprocess on a free port, with `API_KEYS`, `SERVE_FLAGS` and
    `flags`, on `model` (a folder; default: the embedded model). Logs go to tmp/serve.log."""
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(API_KEYS))
    log, store = tmp / "serve.log", tmp / "adapters"
    cmd = [sys.executable, "-m", "gateway.main", "serve", "--port", "0", "--api-keys", str(keys),
           *(["--model", str(model)] if model is not None else []), *SERVE_FLAGS, *flags]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **THREADS})
    try:
        url = _wait_for_banner(proc, log, timeout=300)
        name = model.name if model is not None else "SmolLM2-135M-Instruct"
        yield GatewayServer(url, "sk-test-alpha", name, log, store, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def gateway_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """`switchboard serve` on the embedded model, on a free port, in a subprocess."""
    tmp = tmp_path_factory.mktemp("gateway")
    # Rank 16 at most: an adapter over it fits the upload limit (tests/test_hostile_uploads.py).
    with serve(tmp, "--adapter-dir", str(tmp / "adapters"),
               "--max-adapter-bytes", str(MAX_ADAPTER_BYTES), "--max-lora-rank", "16") as server:
        yield server


def _wait_for_banner(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"serving \S+ at (http://\S+)", log.read_text())
        if m:
            return m.group(1)
        if proc.poll() is not None:
            pytest.fail(f"switchboard serve exited ({proc.returncode}):\n{log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"switchboard serve did not become ready:\n{log.read_text()}")

"""Adapters over HTTP: upload, list, use (`model` = name or `base:name`), delete; tenant
isolation; every bad upload answered 400/409/413 with nothing half-registered; metrics; and
examples/multi_tenant_lora.py. Against a real `switchboard serve` (its own, with a temporary
adapter store, two device slots and a small upload limit)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI
from safetensors.numpy import save_file

from tests.conftest import read_metrics

ROOT = Path(__file__).resolve().parents[1]
BASE = "SmolLM2-135M-Instruct"
KEYS = {"sk-lora-alpha": "alpha", "sk-lora-beta": "beta"}
LIMIT = 8 * 2**20
HIDDEN, KV, LAYERS = 576, 192, 30  # SmolLM2-135M


@dataclass
class Server:
    url: str
    store: Path
    log: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("lora-http")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    store, log = tmp / "adapters", tmp / "serve.log"
    cmd = [sys.executable, "-m", "gateway.main", "serve", "--port", "0", "--api-keys",
           str(tmp / "keys.json"), "--adapter-dir", str(store), "--max-loras", "2",
           "--max-cpu-loras", "2", "--max-lora-rank", "16", "--max-adapter-bytes", str(LIMIT),
           "--kv-pages", "128", "--max-num-seqs", "8", "--log-level", "warning",
           "--public-metrics"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while not (m := re.search(r"serving \S+ at (http://\S+)", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"switchboard serve did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield Server(m.group(1), store, log)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def client(server: Server, key: str = "sk-lora-alpha") -> OpenAI:
    return OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=120)


def auth(key: str = "sk-lora-alpha") -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def make_adapter(folder: Path, r: int = 4, seed: int = 0, hidden: int = HIDDEN,
                 strength: float = 0.5, **config) -> Path:
    """A PEFT-layout LoRA on q_proj/v_proj with non-zero B (written directly, no peft)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(LAYERS):
        for proj, out in (("q_proj", hidden), ("v_proj", KV * hidden // HIDDEN)):
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            a = rng.standard_normal((r, hidden)) / hidden**0.5
            tensors[f"{key}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out, r)) * strength).astype(
                np.float32
            )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
           "target_modules": ["q_proj", "v_proj"], **config}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def upload(server: Server, name: str, folder: Path, key: str = "sk-lora-alpha",
           extra: list | None = None) -> httpx.Response:
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
    return httpx.post(server.v1 + "/adapters", data={"name": name}, files=files + (extra or []),
                      headers=auth(key), timeout=120)


def names(server: Server, key: str = "sk-lora-alpha") -> list[str]:
    r = httpx.get(server.v1 + "/adapters", headers=auth(key))
    assert r.status_code == 200
    return [a["id"] for a in r.json()["data"]]


def first_logprob(c: OpenAI, model: str) -> float:
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                  max_tokens=1, temperature=0, logprobs=True)
    return r.choices[0].logprobs.content[0].logprob


@pytest.fixture(scope="module")
def bot(server: Server, tmp_path_factory) -> str:
    r = upload(server, "support-bot", make_adapter(tmp_path_factory.mktemp("a") / "x"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "support-bot" and body["object"] == "adapter"
    assert body["parent"] == BASE and body["rank"] == 4 and body["owned_by"] == "alpha"
    assert body["target_modules"] == ["q_proj", "v_proj"]
    return "support-bot"


def test_upload_list_and_chat(server: Server, bot: str) -> None:
    c = client(server)
    assert bot in names(server)
    assert httpx.get(f"{server.v1}/adapters/{bot}", headers=auth()).json()["id"] == bot
    models = {m.id: m for m in c.models.list()}
    assert models[bot].parent == BASE and BASE in models
    assert c.models.retrieve(bot).parent == BASE
    base = first_logprob(c, BASE)
    tuned = first_logprob(c, bot)
    assert tuned != base  # the adapter is really applied
    # The second call may start from the first one's cached prefix: other shapes, other bits.
    assert first_logprob(c, f"{BASE}:{bot}") == pytest.approx(tuned, abs=1e-3)
    stream = c.chat.completions.create(model=bot, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, stream=True)
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) >= 1
    r = c.completions.create(model=bot, prompt="Once upon a time", max_tokens=3)
    assert r.choices[0].finish_reason == "length"


def test_tenant_isolation(server: Server, bot: str, tmp_path: Path) -> None:
    beta = client(server, "sk-lora-beta")
    assert names(server, "sk-lora-beta") == []
    assert [m.id for m in beta.models.list()] == [BASE]
    for model in (bot, f"{BASE}:{bot}"):
        with pytest.raises(openai.NotFoundError):
            beta.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    assert httpx.get(f"{server.v1}/adapters/{bot}", headers=auth("sk-lora-beta")).status_code == 404
    r = httpx.delete(f"{server.v1}/adapters/{bot}", headers=auth("sk-lora-beta"))
    assert r.status_code == 404 and bot in names(server)
    # beta's own adapter of the same name is a different adapter.
    r = upload(server, bot, make_adapter(tmp_path / "b", seed=7), "sk-lora-beta")
    assert r.status_code == 200
    assert first_logprob(beta, bot) != first_logprob(client(server), bot)
    r = httpx.delete(f"{server.v1}/adapters/{bot}", headers=auth("sk-lora-beta"))
    assert r.status_code == 200
    assert bot in names(server) and names(server, "sk-lora-beta") == []


def bad_folders(tmp: Path) -> dict[str, tuple[Path, list[str]]]:
    """name -> (folder, phrases the 400 message must contain)."""
    out = {}
    f = make_adapter(tmp / "pickle")
    (f / "adapter_model.safetensors").unlink()
    (f / "adapter_model.bin").write_bytes(pickle.dumps({"x": 1}))
    out["pickle"] = (f, ["adapter_model.bin", "safetensors"])
    out["rank"] = (make_adapter(tmp / "rank", r=20), ["exceeds the max LoRA rank 16"])
    out["other-base"] = (make_adapter(tmp / "other", hidden=64), ["another base model"])
    f = make_adapter(tmp / "corrupt")
    data = (f / "adapter_model.safetensors").read_bytes()
    (f / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    out["corrupt"] = (f, ["truncated"])
    f = make_adapter(tmp / "noconfig")
    (f / "adapter_config.json").unlink()
    out["no-config"] = (f, ["missing adapter_config.json"])
    f = make_adapter(tmp / "two", target_modules=["q_proj", "embed_tokens"], use_dora=True)
    out["two-problems"] = (f, ["embed_tokens", "DoRA"])
    return out


def test_bad_uploads_name_every_problem(server: Server, bot: str, tmp_path: Path) -> None:
    before = names(server)
    for name, (folder, phrases) in bad_folders(tmp_path).items():
        r = upload(server, name, folder)
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_adapter" and name in err["message"]
        for phrase in phrases:
            assert phrase in err["message"], (name, err["message"])
    assert names(server) == before  # nothing half-registered, the others untouched
    assert [p.name for p in (server.store / ".staging").iterdir()] == []
    assert not (server.store / "alpha" / "rank").exists()
    assert first_logprob(client(server), bot)  # still served


def test_bad_requests(server: Server, bot: str, tmp_path: Path) -> None:
    good = make_adapter(tmp_path / "g")
    r = upload(server, bot, good)
    assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_exists"
    assert upload(server, "bad name!", good).status_code == 400
    assert upload(server, f"{BASE}:x", good).status_code == 400
    r = httpx.post(server.v1 + "/adapters", files=[("files", ("a.json", b"{}"))], headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    r = httpx.post(server.v1 + "/adapters", data={"name": "x"}, headers=auth())
    assert r.status_code == 400
    r = httpx.post(server.v1 + "/adapters", json={"name": "x"}, headers=auth())
    assert r.status_code == 400
    big = [("files", ("README.md", b"x" * (LIMIT + 1)))]
    r = upload(server, "big", good, extra=big)
    assert r.status_code == 413 and "big" not in names(server)
    assert httpx.post(server.v1 + "/adapters", data={"name": "x"}).status_code == 401
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="nope", messages=[{"role": "user",
                                                                         "content": "x"}])
    assert httpx.delete(f"{server.v1}/adapters/nope", headers=auth()).status_code == 404


def test_more_adapters_than_slots_and_delete(server: Server, bot: str, tmp_path: Path) -> None:
    extra = [f"tenant-bot-{i}" for i in range(3)]
    for i, name in enumerate(extra):
        assert upload(server, name, make_adapter(tmp_path / name, seed=i + 1)).status_code == 200
    c = client(server)
    models = [bot, *extra, BASE] * 2
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:  # 4 adapters, 2 slots
        replies = list(pool.map(lambda m: c.chat.completions.create(
            model=m, messages=[{"role": "user", "content": "Hello"}], max_tokens=3), models))
    assert all(r.choices[0].finish_reason == "length" for r in replies)
    m = read_metrics(server.url)
    assert m['switchboard_adapter_loads_total{tier="device"}'] >= 4
    assert m['switchboard_adapter_evictions_total{tier="device"}'] >= 2
    assert m['switchboard_adapters_resident{tier="device"}'] == 2
    assert m['switchboard_adapters_resident{tier="host"}'] <= 2
    for name in extra:
        r = httpx.delete(f"{server.v1}/adapters/{name}", headers=auth())
        assert r.status_code == 200 and r.json()["deleted"] is True
        assert not (server.store / "alpha" / name).exists()
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model=extra[0], messages=[{"role": "user", "content": "x"}])
    assert names(server) == [bot]


def test_example_script(server: Server) -> None:
    out = subprocess.run(
        [sys.executable, "examples/multi_tenant_lora.py", "--base-url", server.v1,
         "--api-key", "sk-lora-alpha", "--name", "example-bot", "--max-tokens", "6"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "uploaded example-bot" in out.stdout and "[example-bot]" in out.stdout
    assert "deleted example-bot" in out.stdout and "example-bot" not in names(server)

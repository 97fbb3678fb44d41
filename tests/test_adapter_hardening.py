"""Issue 16, adapters: one tenant's adapter never stops the engine (every scaling is a float32
at upload; a failure while loading one request's adapter fails that request alone), per-tenant
adapter quotas (count and bytes, also under concurrent uploads and across replicas), the served
model's name reserved, pickles beside safetensors refused, `/v1/models` without Redis, and
error messages that never echo a huge `model` in full."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.kv.page_allocator import PageAllocator
from gateway import redis_store
from gateway.adapters.store import SharedAdapterStore, new_version
from lora.adapter import AdapterError, load_adapter
from lora.manager import AdapterManager
from lora.quota import AdapterQuota, QuotaExceeded
from lora.slots import LoraSlots
from tests import lora_files as lf
from tests.conftest import ROOT, SERVE_FLAGS, THREADS, _wait_for_banner
from tests.test_hostile_uploads import SMOLLM2
from tests.test_sessions import redis_server, redis_url  # noqa: F401 - module-scoped fixtures
from tests.tiny_models import save_peft_adapter, save_tiny

GREEDY = dict(temperature=0, ignore_eos=True, max_tokens=6)


def write_adapter(folder: Path, **fields) -> Path:
    """An upload-ready SmolLM2 adapter folder (tests/lora_files.py) with config `fields`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in lf.adapter(**fields):
        (folder / name).write_bytes(data)
    return folder


# -- every scaling is a float32, checked where the adapter enters ---------------------------


@pytest.mark.parametrize(("fields", "phrase"), [
    (dict(lora_alpha=1e308), "lora_alpha / r = 1e+308 / 4 = 2.5e+307 is outside float32"),
    (dict(lora_alpha=1e39, use_rslora=True), "lora_alpha / sqrt(r) = 1e+39 / sqrt(4) = 5e+38"),
    (dict(lora_alpha=1e-40), "outside float32's range"),
    (dict(alpha_pattern={"q_proj": 1e300}), "model.layers.0.self_attn.q_proj: rank_pattern / "
     "alpha_pattern give it the scaling 2.5e+299"),
    # Both scalings fit, but their ratio (folded into B in the slot) does not.
    (dict(lora_alpha=1e-30, alpha_pattern={"v_proj": 1e30}), "1e+60 times the default"),
    # The ratio fits, but B times it (what the slot holds) overflows.
    (dict(lora_alpha=1e-30, alpha_pattern={"q_proj": 1e8}),
     "model.layers.0.self_attn.q_proj: lora_A, or lora_B times its scaling ratio 1e+38, "
     "overflows torch.float32"),
])
def test_scalings_beyond_float32_are_refused(tmp_path: Path, fields: dict, phrase: str) -> None:
    with pytest.raises(AdapterError) as e:
        load_adapter(write_adapter(tmp_path / "a", **fields), SMOLLM2, max_rank=16)
    assert any(phrase in p for p in e.value.problems), e.value.problems


def test_pickle_beside_safetensors_is_refused(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a")
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04not opened")
    with pytest.raises(AdapterError) as e:
        load_adapter(folder, SMOLLM2, max_rank=16)
    assert e.value.problems == [
        "adapter_model.bin: pickled weights are never loaded (unpickling runs arbitrary code); "
        "remove them, adapter_model.safetensors holds the weights"]


def test_a_bad_stored_adapter_is_skipped_at_start(tmp_path: Path) -> None:
    """An adapter stored before validation got stricter is not served after a restart (and
    the manager starts), while the tenant's sound adapter is."""
    write_adapter(tmp_path / "alpha" / "overflow", lora_alpha=1e308)
    write_adapter(tmp_path / "alpha" / "sound")
    slots = LoraSlots(SMOLLM2, num_slots=1, pool_rows=4, max_rank=4)
    manager = AdapterManager(SMOLLM2, slots, 2, store_dir=tmp_path)
    assert [a.name for a in manager.list("alpha")] == ["sound"]
    assert manager.list("alpha")[0].stored_bytes == sum(
        f.stat().st_size for f in (tmp_path / "alpha" / "sound").iterdir())


# -- a failure while preparing one request's adapter fails that request alone ----------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir) -> tuple[Path, Path]:
    """A small random Llama with SmolLM2's tokenizer, and a real PEFT adapter for it."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("hardening")
    base = save_tiny(root / "tiny", "llama")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / f, base / f)
    return base, save_peft_adapter(base, root / "good", seed=1)


def _overflowing(llm: LLM, tmp: Path, good: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter of issue 16 as it was registered before scalings (and weights' gains) were
    checked: alpha 1e308 overflows float32 when its slot's scale is set."""
    folder = shutil.copytree(good, tmp / "boom")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 1e308}))
    with monkeypatch.context() as m:
        m.setattr("lora.validate._check_scales", lambda *a: [], raising=False)
        m.setattr("lora.adapter.check_gain", lambda *a: None, raising=False)
        llm.load_adapter("boom", folder)


def _raising_slot_copy(llm: LLM, tmp: Path, good: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sound adapter whose copy into a device slot fails (as a device error would)."""
    llm.load_adapter("boom", shutil.copytree(good, tmp / "boom"))
    load = LoraSlots.load

    def failing(self: LoraSlots, slot: int, adapter) -> None:  # noqa: ANN001
        if adapter.name == "boom":
            raise RuntimeError("CUDA error: out of memory")
        load(self, slot, adapter)

    monkeypatch.setattr(LoraSlots, "load", failing)


@pytest.mark.parametrize("make", [_overflowing, _raising_slot_copy])
def test_an_adapter_that_fails_to_load_fails_its_request_alone(
        tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make) -> None:  # noqa: ANN001
    base, good = tiny
    llm = LLM(model=str(base), max_loras=2, max_lora_rank=8, num_pages=64, page_size=4)
    llm.load_adapter("good", good)
    make(llm, tmp_path, good, monkeypatch)
    healthy = [([5, 6, 7, 8, 9], SamplingParams(**GREEDY)),
               ([10, 11, 12], SamplingParams(adapter="good", **GREEDY))]
    alone = [llm.generate(p, sp)[0] for p, sp in healthy]
    boom = ([13, 14], SamplingParams(adapter="boom", **GREEDY))
    outs = llm.generate([p for p, _ in [boom, *healthy, boom]],
                        [sp for _, sp in [boom, *healthy, boom]])
    for out in (outs[0], outs[-1]):
        assert out.finish_reason == "error" and out.token_ids == []
        assert "adapter 'boom' could not be loaded into a device slot" in out.error, out.error
    for out, ref in zip(outs[1:3], alone, strict=True):
        assert (out.token_ids, out.finish_reason, out.error) == (ref.token_ids, "length", None)
    # The slot it failed in serves the next adapter, and nothing is held.
    assert llm.generate(*healthy[1])[0].token_ids == alone[1].token_ids
    llm.engine.reset_prefix_cache()
    assert llm.engine.allocator.num_used == 0


def test_a_request_whose_admission_raises_fails_alone() -> None:
    """The scheduler's per-request predicates (grammar ready, adapter resident) do that
    request's work; one that raises puts that request in `batch.failed`, never the step."""

    class Adapters:
        def can_admit(self, req: Request) -> bool:
            if req.params.adapter == "broken":
                raise RuntimeError("slot copy failed")
            return True

    sched = Scheduler(PageAllocator(32), 4, 8, 64, adapters=Adapters())
    reqs = [Request(rid, [1, 2, 3], SamplingParams(max_tokens=4, adapter=a))
            for rid, a in (("a", None), ("b", "broken"), ("c", "fine"))]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert [s.request.request_id for s in batch.seqs] == ["a", "c"]
    assert [(r.request_id, why) for r, why in batch.failed] == [
        ("b", "could not start: RuntimeError: slot copy failed")]


# -- over HTTP: quotas, names, pickles, long names, /v1/models without Redis ----------------

BASE = "SmolLM2-135M-Instruct"
ONE_ADAPTER = sum(len(data) for _, data in lf.adapter())  # bytes an upload of lf.adapter() stores
KEYS = {
    "sk-h-alpha": {"tenant": "alpha", "max_adapters": 2},
    "sk-h-beta": {"tenant": "beta", "max_adapter_storage_bytes": ONE_ADAPTER * 3 // 2},
    "sk-h-gamma": "gamma",  # the server-wide quota: --max-adapters-per-tenant 3
    "sk-h-delta": "delta",  # refused uploads only
}


@dataclass
class Server:
    url: str
    store: Path
    proc: subprocess.Popen

    def post(self, name: str, files: lf.Files, key: str) -> httpx.Response:
        return httpx.post(self.url + "/v1/adapters", data={"name": name}, timeout=120,
                          files=[("files", f) for f in files],
                          headers={"Authorization": f"Bearer {key}"})

    def get(self, path: str, key: str) -> httpx.Response:
        return httpx.get(self.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    def delete(self, path: str, key: str) -> httpx.Response:
        return httpx.delete(self.url + path, headers={"Authorization": f"Bearer {key}"})

    def stored(self) -> list[str]:
        """The adapter folders in the store, as tenant/name."""
        return sorted(f"{p.parent.name}/{p.name}" for p in self.store.glob("*/*")
                      if p.parent.name != ".staging")


def _serve(tmp: Path, *flags: str) -> Server:
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    log, store = tmp / "serve.log", tmp / "adapters"
    cmd = [sys.executable, "-m", "gateway.main", "serve", "--port", "0", "--api-keys",
           str(tmp / "keys.json"), "--adapter-dir", str(store), "--max-adapters-per-tenant", "3",
           *SERVE_FLAGS, *flags]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **THREADS})
    return Server(_wait_for_banner(proc, log, timeout=300), store, proc)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = _serve(tmp_path_factory.mktemp("hardening-http"))
    yield s
    s.proc.terminate()
    s.proc.wait(20)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_an_overflowing_scaling_is_a_400_at_upload(server: Server) -> None:
    err = _error(server.post("big", lf.adapter(lora_alpha=1e308), "sk-h-delta"), 400)
    assert err["code"] == "invalid_adapter"
    assert "lora_alpha / r = 1e+308 / 4 = 2.5e+307 is outside float32" in err["message"]
    assert "delta/big" not in server.stored()


def test_the_adapter_count_quota(server: Server) -> None:
    for name in ("one", "two"):
        assert server.post(name, lf.adapter(), "sk-h-alpha").status_code == 200
    before = server.stored()
    err = _error(server.post("three", lf.adapter(), "sk-h-alpha"), 403)
    assert err["code"] == "adapter_quota_exceeded" and err["type"] == "invalid_request_error"
    assert "stores 2 adapters, the most it may store is 2" in err["message"]
    assert server.stored() == before and not any((server.store / ".staging").iterdir())
    assert [a["id"] for a in server.get("/v1/adapters", "sk-h-alpha").json()["data"]] == [
        "one", "two"]
    assert server.delete("/v1/adapters/one", "sk-h-alpha").status_code == 200
    assert server.post("three", lf.adapter(), "sk-h-alpha").status_code == 200


def test_the_storage_quota_counts_every_stored_byte(server: Server) -> None:
    first = server.post("one", lf.adapter(), "sk-h-beta")
    assert first.status_code == 200 and first.json()["stored_bytes"] == ONE_ADAPTER
    err = _error(server.post("two", lf.adapter(), "sk-h-beta"), 403)
    assert err["code"] == "adapter_quota_exceeded"
    assert f"take {ONE_ADAPTER} bytes, this upload {ONE_ADAPTER} more" in err["message"]
    assert "beta/two" not in server.stored()


def test_concurrent_uploads_do_not_pass_the_quota_together(server: Server) -> None:
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: server.post(f"c{i}", lf.adapter(), "sk-h-gamma")
                              .status_code, range(8)))
    assert sorted(codes) == [200] * 3 + [403] * 5
    assert len([s for s in server.stored() if s.startswith("gamma/")]) == 3
    assert len(server.get("/v1/adapters", "sk-h-gamma").json()["data"]) == 3


def test_the_served_model_name_is_reserved(server: Server) -> None:
    err = _error(server.post(BASE, lf.adapter(), "sk-h-alpha"), 400)
    assert err["param"] == "name" and "served model's name" in err["message"]
    ids = [m["id"] for m in server.get("/v1/models", "sk-h-alpha").json()["data"]]
    assert ids.count(BASE) == 1


def test_a_pickle_beside_safetensors_is_a_400(server: Server) -> None:
    files = [*lf.adapter(), ("adapter_model.bin", b"\x80\x04never unpickled")]
    err = _error(server.post("pickled", files, "sk-h-delta"), 400)
    assert "adapter_model.bin: pickled weights are never loaded" in err["message"]
    assert "delta/pickled" not in server.stored()


def test_errors_do_not_echo_a_huge_name(server: Server) -> None:
    huge = "m" * 100_000
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": "Bearer sk-h-delta"},
                   json={"model": huge, "messages": [{"role": "user", "content": "hi"}]})
    err = _error(r, 404)
    assert err["message"] == f"The model '{'m' * 64}…' does not exist."
    err = _error(server.post(huge, lf.adapter(), "sk-h-delta"), 400)
    assert len(err["message"]) < 400 and "m" * 64 + "…" in err["message"]
    err = _error(server.get(f"/v1/adapters/{'a' * 4000}", "sk-h-delta"), 404)
    assert err["message"] == f"The adapter '{'a' * 64}…' does not exist."


# -- with a shared registry (--redis-url) ---------------------------------------------------


def test_the_shared_registry_enforces_the_quota_atomically(redis_url: str) -> None:  # noqa: F811
    """Replicas check a tenant's quota in the Redis script that registers an upload: eight
    concurrent publishes through two clients (two replicas) register exactly the quota."""
    quota = AdapterQuota(max_adapters=3, max_bytes=10**9)

    async def main() -> list[str | BaseException]:
        clients = [redis_store.connect(redis_url, decode=False) for _ in range(2)]
        stores = [SharedAdapterStore(c) for c in clients]
        meta = {"created": 0, "stored_bytes": 10}
        results = await asyncio.gather(*(
            stores[i % 2].publish("quota-t", f"a{i}", {**meta, "id": f"a{i}"}, {"f": b"x"},
                                  quota, new_version()) for i in range(8)),
            return_exceptions=True)
        assert (await stores[0].usage("quota-t")) == (3, 30)
        with pytest.raises(QuotaExceeded, match="storage quota exceeded"):
            await stores[0].publish("quota-t2", "big", {"id": "big", "created": 0,
                                                        "stored_bytes": 11}, {"f": b"x"},
                                    AdapterQuota(3, 10), new_version())
        assert await stores[0].list("quota-t2") == []
        for c in clients:
            await c.aclose()
        return results

    results = asyncio.run(main())
    assert sum(r is True for r in results) == 3
    assert sum(isinstance(r, QuotaExceeded) for r in results) == 5


def test_shared_quota_and_models_while_redis_is_down(tmp_path_factory, redis_server,  # noqa: F811
                                                     redis_url: str) -> None:  # noqa: F811
    s = _serve(tmp_path_factory.mktemp("hardening-redis"), "--redis-url", redis_url)
    try:
        for name in ("one", "two"):
            assert s.post(name, lf.adapter(), "sk-h-alpha").status_code == 200
        err = _error(s.post("three", lf.adapter(), "sk-h-alpha"), 403)
        assert err["code"] == "adapter_quota_exceeded"
        assert "alpha/three" not in s.stored()
        redis_server.terminate()  # the module's last use of Redis
        redis_server.wait(10)
        r = s.get("/v1/models", "sk-h-alpha")
        assert r.status_code == 200, r.text
        assert [m["id"] for m in r.json()["data"]] == [BASE, "one", "two"]
    finally:
        s.proc.terminate()
        s.proc.wait(20)

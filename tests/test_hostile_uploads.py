"""Hostile adapter uploads, one table: each is refused with a 4xx in OpenAI's error shape that
names the problem, and leaves the adapter store exactly as it was. Against the shared
`gateway_server` (its store is a temporary folder; its upload limit is MAX_ADAPTER_BYTES)."""

from __future__ import annotations

import json
import pickle
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.numpy import save

from engine.config import ModelConfig
from lora.adapter import AdapterError, load_adapter
from tests import lora_files as lf
from tests.conftest import MAX_ADAPTER_BYTES, GatewayServer
from tests.lora_files import CONFIG, Q_A, WEIGHTS, Files, adapter, config, safetensors, tensors

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=lf.HIDDEN, intermediate_size=1536,
                      num_layers=lf.LAYERS, num_heads=9, num_kv_heads=3, head_dim=64,
                      max_position=2048)
PICKLE = pickle.dumps({Q_A: [[0.0]]})
DEEP = b"[" * 100_000 + b"]" * 100_000
# id: (adapter name, files, status, phrases the error message names)
CASES: dict[str, tuple[str, Files, int, list[str]]] = {
    "pickle-bin": ("p", [(CONFIG, config()), ("adapter_model.bin", PICKLE)], 400,
                   ["adapter_model.bin", "pickled weights are never loaded"]),
    "pickle-pt": ("p", [(CONFIG, config()), ("weights.pt", PICKLE)], 400,
                  ["weights.pt", "pickled weights are never loaded"]),
    "file-traversal": ("t", [("../adapter_config.json", config()), *adapter()[1:]], 400,
                       ["bad file name '../adapter_config.json'", "without directories"]),
    "file-absolute": ("t", [*adapter(), ("/etc/passwd", b"x")], 400, ["'/etc/passwd'"]),
    "file-in-folder": ("t", [("sub/" + CONFIG, config()), *adapter()[1:]], 400,
                       ["'sub/adapter_config.json'"]),
    "file-backslash": ("t", [*adapter(), ("..\\x", b"x")], 400, ["bad file name"]),
    "file-name-too-long": ("t", [*adapter(), ("a" * 300, b"x")], 400, ["bad file name"]),
    "file-twice": ("t", [*adapter(), (CONFIG, config())], 400, ["sent twice"]),
    "name-traversal": ("../x", adapter(), 400, ["adapter name '../x' must be"]),
    "name-absolute": ("/tmp/x", adapter(), 400, ["adapter name '/tmp/x' must be"]),
    "name-dotdot": ("..", adapter(), 400, ["adapter name '..' must be"]),
    "name-too-long": ("a" * 65, adapter(), 400, ["must be 1-64 characters"]),
    "oversized": ("big", [*adapter(), ("README.md", b"x" * MAX_ADAPTER_BYTES)], 413,
                  [f"exceeds {MAX_ADAPTER_BYTES} bytes"]),
    "wrong-shape": ("s", adapter(save(tensors(hidden=64))), 400,
                    ["lora_A has shape [4, 64], expected [4, 576]", "another base model"]),
    "nan": ("n", adapter(save(tensors(poison=float("nan")))), 400, [Q_A, "NaN or Inf"]),
    "inf": ("n", adapter(save(tensors(poison=float("-inf")))), 400, [Q_A, "NaN or Inf"]),
    "config-lies-about-rank": ("r", adapter(r=8), 400,
                               ["tensors have rank 4 but adapter_config.json says r=8"]),
    "rank-over-limit": ("r", adapter(save(tensors(r=32)), r=32), 400,
                        ["rank 32 exceeds the max LoRA rank 16"]),
    "truncated-length": ("h", adapter(b"\x10\0\0"), 400, ["truncated (3 bytes)"]),
    "truncated-header": ("h", adapter(safetensors(b'{"a": {"dtype"', claimed_len=4096)), 400,
                         ["truncated: header claims 4096 bytes"]),
    "header-length-huge": ("h", adapter(safetensors(b"{}", claimed_len=1 << 60)), 400,
                           [f"header claims {1 << 60} bytes, over the"]),
    "huge-tensor": ("h", adapter(safetensors(
        {Q_A: {"dtype": "F32", "shape": [1 << 40, 576], "data_offsets": [0, 64]}}, b"\0" * 64)),
        400, [f"claims {(1 << 40) * 576 * 4} bytes", "only 64 bytes of data"]),
    "header-nested-deep": ("h", adapter(safetensors(DEEP)), 400, ["header is not valid JSON"]),
    "header-dtype-not-a-string": ("h", adapter(safetensors(
        {Q_A: {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)), 400,
        ["unknown dtype ['F32']"]),
    "config-nested-deep": ("c", [(CONFIG, DEEP), *adapter()[1:]], 400,
                           ["adapter_config.json is not valid JSON"]),
    "config-not-json": ("c", [(CONFIG, b"\xff\xfe{"), *adapter()[1:]], 400,
                        ["adapter_config.json is not valid JSON"]),
    "config-alpha-beyond-float": ("c", adapter(lora_alpha=10**400), 400,
                                  ["lora_alpha must be a positive number"]),
    "config-rank-pattern-not-object": ("c", adapter(rank_pattern=[4]), 400,
                                       ["rank_pattern must be an object"]),
    "config-pattern-redos": ("c", adapter(rank_pattern={"(.|..)*(.|..)*y": 4}), 400,
                             ["catastrophic backtracking"]),
}


def store_files(server: GatewayServer) -> list[str]:
    """Every file and folder in the store except the (empty) staging folder."""
    root = server.adapter_dir
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != ".staging")


def post(server: GatewayServer, name: str, files: Files | Iterator[bytes],
         key: str = "sk-test-alpha") -> httpx.Response:
    auth = {"Authorization": f"Bearer {key}"}
    if isinstance(files, list):
        return httpx.post(server.base_url + "/adapters", data={"name": name}, headers=auth,
                          files=[("files", f) for f in files], timeout=120)
    return httpx.post(server.base_url + "/adapters", content=files, timeout=120, headers={
        **auth, "Content-Type": "multipart/form-data; boundary=b0undary"})


@pytest.mark.parametrize("case", CASES)
def test_hostile_upload_refused_and_nothing_stored(gateway_server: GatewayServer,
                                                   case: str) -> None:
    name, files, status, phrases = CASES[case]
    before = store_files(gateway_server)
    r = post(gateway_server, name, files)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    for phrase in phrases:
        assert phrase in message, message
    assert store_files(gateway_server) == before
    assert not any((gateway_server.adapter_dir / ".staging").iterdir())


def test_oversized_stream_without_length_is_cut_off(gateway_server: GatewayServer) -> None:
    """A chunked body (no Content-Length) is read only up to the limit, then refused."""
    def body() -> Iterator[bytes]:
        yield (b'--b0undary\r\nContent-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
               b'--b0undary\r\nContent-Disposition: form-data; name="files"; '
               b'filename="README.md"\r\n\r\n')
        for _ in range(MAX_ADAPTER_BYTES // 2**16 + 2):
            yield b"x" * 2**16
        yield b"\r\n--b0undary--\r\n"

    before = store_files(gateway_server)
    r = post(gateway_server, "big", body())
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    assert store_files(gateway_server) == before


def test_a_sound_upload_is_stored(gateway_server: GatewayServer) -> None:
    """The same path accepts a good adapter (so the refusals above are not blanket ones)."""
    r = post(gateway_server, "sound", adapter(), key="sk-test-beta")
    assert r.status_code == 200, r.text
    assert sorted(p.name for p in (gateway_server.adapter_dir / "beta" / "sound").iterdir()) \
        == [CONFIG, WEIGHTS]
    auth = {"Authorization": "Bearer sk-test-beta"}
    assert httpx.delete(gateway_server.base_url + "/adapters/sound", headers=auth).is_success
    assert not (gateway_server.adapter_dir / "beta" / "sound").exists()


def test_a_hundred_thousand_problems_make_a_short_error(
        gateway_server: GatewayServer) -> None:
    """A header listing 100,000 bogus (empty) tensors has a problem each: the 400 lists the
    first ten and counts the rest, in a body of a few KB (it was 22 MB)."""
    n = 100_000
    header = {f"t{'x' * 2000 if i == 0 else ''}{i}": {"dtype": "U8", "shape": [0],
                                                       "data_offsets": [0, 0]}
              for i in range(n)}  # the first name 2 KB long: one problem is cut short too
    weights = safetensors(json.dumps(header, separators=(",", ":")).encode())
    assert len(weights) < MAX_ADAPTER_BYTES
    before = store_files(gateway_server)
    r = post(gateway_server, "many", adapter(weights))
    assert r.status_code == 400, r.text[:1000]
    assert len(r.content) < 8192, len(r.content)
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "invalid_adapter", "files")
    message = error["message"]
    assert message.count("unexpected tensor") == 10 and "... and 99,990 more" in message
    assert "'t1'" in message and "'t10'" not in message
    assert store_files(gateway_server) == before


def test_claims_never_allocate(tmp_path: Path) -> None:
    """Huge header claims are refused before anything of their size is allocated."""
    claims = {Q_A: {"dtype": "F32", "shape": [1 << 28, 576], "data_offsets": [0, 576 << 30]}}
    for weights in (safetensors(claims, b"\0" * 64), safetensors(b"{}", claimed_len=15 << 20)):
        (tmp_path / CONFIG).write_bytes(config())
        (tmp_path / WEIGHTS).write_bytes(weights)
        tracemalloc.start()
        with pytest.raises(AdapterError):
            load_adapter(tmp_path, SMOLLM2, max_rank=16)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 1 << 20, peak


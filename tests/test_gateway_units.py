"""Gateway pieces without a model or a server: config, auth, limits, error mapping, request
planning. Milliseconds each."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.sampling.params import InvalidRequestError, SamplingParams
from gateway.access.auth import Authenticator
from gateway.access.limits import TenantLimiter, check_capacity
from gateway.config import ConfigError, TenantLimits, build_config
from gateway.errors import APIError, from_validation
from gateway.openai.params import EngineFacts, chat_input, plan_chat, plan_completion
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.openai.tokenizer import GatewayTokenizer

ROOT = Path(__file__).resolve().parents[1]


# -- config -------------------------------------------------------------------------------


def test_flags_override_toml_and_keys_resolve_relative_to_it(tmp_path: Path) -> None:
    (tmp_path / "keys.json").write_text(json.dumps({
        "sk-a": "alpha", "sk-a2": "alpha",
        "sk-b": {"tenant": "beta", "max_concurrent_requests": 2, "tokens_per_minute": 900},
    }))
    toml = tmp_path / "serve.toml"
    toml.write_text('port = 9000\nmax_num_seqs = 4\napi_keys = "keys.json"\n'
                    '[default_limits]\ntokens_per_minute = 100\n')
    cfg = build_config(toml, port=9100, kv_pages=64, host=None)
    assert (cfg.port, cfg.max_num_seqs, cfg.host) == (9100, 4, "127.0.0.1")
    assert cfg.api_keys == {"sk-a": "alpha", "sk-a2": "alpha", "sk-b": "beta"}
    assert cfg.limits_for("beta") == TenantLimits(max_concurrent_requests=2,
                                                  tokens_per_minute=900)
    assert cfg.limits_for("alpha").tokens_per_minute == 100
    ec = cfg.engine_config()
    assert (ec.num_pages, ec.max_num_seqs, ec.model) == (64, 4, None)
    assert cfg.model_name == "SmolLM2-135M-Instruct"
    assert build_config(model="/m/Qwen2-0.5B").model_name == "Qwen2-0.5B"
    assert build_config(model="/m/tiny.gguf", served_model_name="x").model_name == "x"


@pytest.mark.parametrize("overrides, needle", [
    ({"port": 70000}, "port"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"dtype": "int3"}, "dtype"),
    ({"bogus": 1}, "bogus"),
])
def test_invalid_settings_name_the_setting(overrides: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build_config(**overrides)


@pytest.mark.parametrize("content, needle", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"sk-a": 5}', "tenant name"),
    ('{"sk-a": {"tenant": "a", "tokens_per_minute": 0}}', "tokens_per_minute"),
    ('{"sk-a": {"tenant": "a", "max_concurrent_requests": 1},'
     ' "sk-b": {"tenant": "a", "max_concurrent_requests": 2}}', "different limits"),
    ("{}", "no keys"),
])
def test_bad_api_keys_file(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=needle):
        build_config(api_keys=str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        build_config(api_keys=str(tmp_path / "missing.json"))


def test_serve_flags_parse_into_one_config() -> None:
    import argparse

    from gateway.cli import add_serve_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--kv-pages", "32", "--max-num-seqs", "2", "--port", "0"])
    cfg = config_from_args(args)
    assert (cfg.kv_pages, cfg.max_num_seqs, cfg.port, cfg.api_keys) == (32, 2, 0, None)


# -- auth and limits ----------------------------------------------------------------------


def test_auth() -> None:
    assert Authenticator(None).tenant_for(None) == "default"
    auth = Authenticator({"sk-alpha-123456": "alpha"})
    assert auth.tenant_for("Bearer sk-alpha-123456") == "alpha"
    assert auth.tenant_for("bearer  sk-alpha-123456 ") == "alpha"
    for header in (None, "", "Bearer", "Basic sk-alpha-123456", "Bearer sk-wrong-123456"):
        with pytest.raises(APIError) as e:
            auth.tenant_for(header)
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
        assert "sk-wrong-123456" not in e.value.message  # keys are redacted


def test_tenant_concurrency_and_tokens_per_minute() -> None:
    now = [1000.0]
    limits = {"a": TenantLimits(max_concurrent_requests=1),
              "t": TenantLimits(tokens_per_minute=40)}
    limiter = TenantLimiter(lambda t: limits.get(t, TenantLimits()), clock=lambda: now[0])
    lim = SimpleNamespace(admit=lambda tenant: asyncio.run(limiter.admit(tenant)))
    ticket = lim.admit("a")
    with pytest.raises(APIError) as e:
        lim.admit("a")
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
    ticket.release()
    ticket.release()  # idempotent
    lim.admit("a")
    lim.admit("unlimited")
    lim.admit("unlimited")

    lim.admit("t").record_tokens(30)
    now[0] += 10
    lim.admit("t").record_tokens(20)  # 50 >= 40 now
    now[0] += 5
    with pytest.raises(APIError) as e:
        lim.admit("t")
    assert e.value.code == "tokens_per_minute_exceeded"
    assert e.value.headers["Retry-After"] == "45"  # the first 30 tokens expire in 45 s
    now[0] += 46
    lim.admit("t")


def test_capacity() -> None:
    check_capacity(outstanding=10, new=2, max_num_seqs=4, max_queue=8)
    with pytest.raises(APIError) as e:
        check_capacity(outstanding=11, new=2, max_num_seqs=4, max_queue=8)
    assert e.value.status == 429 and "Retry-After" in e.value.headers
    with pytest.raises(APIError) as e:
        check_capacity(outstanding=0, new=13, max_num_seqs=4, max_queue=8)
    assert e.value.status == 400 and e.value.param == "n"


# -- request validation and planning ------------------------------------------------------


def _error(schema, body: dict | str) -> APIError:
    raw = body if isinstance(body, str) else json.dumps(body)
    with pytest.raises(Exception) as e:
        schema.model_validate_json(raw)
    return from_validation(e.value.errors())


def test_validation_errors_name_the_param() -> None:
    msg = [{"role": "user", "content": "hi"}]
    cases = [
        ({"model": "m"}, "messages", "Missing required parameter"),
        ({"model": "m", "messages": msg, "temperature": "hot"}, "temperature", "number"),
        ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content",
         "string"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]", "not supported"),
        ({"model": "m", "messages": msg, "top_logprobs": 2}, None, "requires logprobs"),
        ({"model": "m", "messages": msg, "stop": ["a", ""]}, "stop", "non-empty"),
        ({"model": "m", "messages": msg, "stop": "x" * 513}, "stop", "at most"),
        ({"model": "m", "messages": msg, "seed": 2**70}, "seed", "less than"),
        ({"model": "m", "messages": msg, "top_k": 10**20}, "top_k", "less than"),
    ]
    for body, param, text in cases:
        err = _error(ChatCompletionRequest, body)
        assert err.status == 400 and err.param == param and text in err.message, body
    assert _error(ChatCompletionRequest, "{not json").code == "invalid_json"
    assert _error(CompletionRequest, {"model": "m", "prompt": []}).param == "prompt"


class _FakeHF:
    def __len__(self) -> int:
        return 1000

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return " ".join(m["content"] for m in messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]


def _facts(max_model_len: int = 100, cap: int | None = None) -> EngineFacts:
    def validate(ids: list[int], p: SamplingParams) -> None:
        if len(ids) + p.max_tokens > max_model_len:
            raise InvalidRequestError("too long", "prompt")

    return EngineFacts(max_model_len, validate, cap)


def test_plan_defaults_seeds_and_extras() -> None:
    tok = GatewayTokenizer(_FakeHF())
    body = ChatCompletionRequest.model_validate_json(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "one two three"}], "n": 3,
        "seed": 5, "top_k": 0, "logit_bias": {"7": 2.5}, "logprobs": True, "top_logprobs": 2,
        "min_p": 0.1, "ignore_eos": True, "foo": "unknown fields are ignored",
    }))
    jobs = plan_chat(chat_input(body), tok, _facts(), adapter=None).jobs
    assert [j.index for j in jobs] == [0, 1, 2]
    p = jobs[0].params
    assert p.max_tokens == 97 and p.top_k == -1 and p.logit_bias == {7: 2.5}
    assert (p.logprobs, p.min_p, p.ignore_eos, p.temperature) == (2, 0.1, True, 1.0)
    assert [j.params.seed for j in jobs] == [5, 6, 7]
    assert plan_chat(chat_input(body), tok, _facts(cap=16), None).jobs[0].params.max_tokens == 16

    comp = CompletionRequest.model_validate_json(
        '{"model": "m", "prompt": ["a b", "c"], "n": 2, "max_tokens": 4, "logprobs": 0}')
    jobs = plan_completion(comp, tok, _facts(), None).jobs
    assert [(j.index, j.prompt_index, j.prompt_ids) for j in jobs] == [
        (0, 0, [1, 1]), (1, 0, [1, 1]), (2, 1, [1]), (3, 1, [1])]


def test_plan_maps_engine_refusals_to_400() -> None:
    tok = GatewayTokenizer(_FakeHF())
    body = ChatCompletionRequest.model_validate_json(
        '{"model": "m", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 99}')
    with pytest.raises(APIError) as e:
        plan_chat(chat_input(body), tok, _facts(), None)
    assert e.value.status == 400 and e.value.param == "messages"
    bad = ChatCompletionRequest.model_validate_json(
        '{"model": "m", "messages": [{"role": "user", "content": "a"}], "logit_bias": {"5000": 1}}')
    with pytest.raises(APIError, match="out of range"):
        plan_chat(chat_input(bad), tok, _facts(), None)

    class _StrictTemplate(_FakeHF):
        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("roles must alternate")

    with pytest.raises(APIError) as e:
        plan_chat(chat_input(body), GatewayTokenizer(_StrictTemplate()), _facts(), None)
    assert e.value.status == 400 and "alternate" in e.value.message


def test_chat_input_refuses_bad_specs() -> None:
    tok = GatewayTokenizer(_FakeHF())

    def chat(**extra) -> ChatCompletionRequest:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
        return ChatCompletionRequest.model_validate_json(json.dumps(body))

    body = chat(response_format={"type": "text"}, tool_choice="none",
                tools=[{"type": "function", "function": {"name": "f"}}], session_id="s1")
    assert plan_chat(chat_input(body), tok, _facts(), None).constraint is None
    for extra, param in [({"response_format": {"type": "json_schema"}}, "response_format"),
                         ({"tools": [{"type": "function"}]}, "tools"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}],
                           "response_format": {"type": "json_object"}}, "response_format")]:
        with pytest.raises(APIError) as e:
            plan_chat(chat_input(chat(**extra)), tok, _facts(), None)
        assert e.value.status == 400 and e.value.param.startswith(param)


def test_gateway_modules_do_not_import_torch() -> None:
    code = ("import sys, gateway.app, gateway.cli, gateway.server, engine.ipc.async_engine; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_serve_refuses_a_bad_config_or_model(tmp_path: Path) -> None:
    def serve(*flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "gateway.main", "serve", "--port", "0", *flags]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})

    r = serve("--max-num-seqs", "0")
    assert r.returncode == 2 and "max_num_seqs" in r.stderr
    r = serve("--model", str(tmp_path / "missing"))
    assert r.returncode == 1 and "unknown model path" in r.stderr


def test_not_ready_answers_503_while_health_stays_live() -> None:
    import asyncio

    import httpx

    from gateway.app import create_app
    from gateway.config import ServeConfig

    app = create_app(ServeConfig(api_keys={"sk-k": "t"}))  # never started: the model never loads
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}]}

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            h = {"Authorization": "Bearer sk-k"}
            return [await c.get("/health"), await c.get("/ready"),
                    await c.post("/v1/chat/completions", json=body, headers=h),
                    await c.post("/v1/chat/completions", json=body),
                    await c.get("/v1/models", headers=h)]

    health, ready, chat, no_key, models = asyncio.run(main())
    assert health.status_code == 200 and models.status_code == 200
    for r in (ready, chat):
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "model_not_ready"
    assert no_key.status_code == 401 and no_key.headers["WWW-Authenticate"] == "Bearer"


def test_health_fails_once_the_model_failed_to_load(tmp_path: Path) -> None:
    """Liveness tells the truth: a server that can never serve (here its model is missing)
    answers /health with a 503 naming why, as /ready does, so that a probe restarts it."""
    import httpx

    from gateway.app import create_app
    from gateway.config import ServeConfig

    app = create_app(ServeConfig(model=str(tmp_path / "missing"), cache_dir=tmp_path))

    async def main() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            await asyncio.to_thread(app.state.runtime.loaded.wait, 60)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
                return [await c.get("/health"), await c.get("/ready")]

    for r in asyncio.run(main()):
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "model_load_failed" and "unknown model path" in error["message"]


def test_device_and_dtype_auto_settle_before_loading() -> None:
    """`--device auto` is CUDA when a GPU is present; `--dtype auto` float32 on a CPU, on a
    GPU the checkpoint's (bfloat16 for a float32 or unnamed one); given values stay."""
    from engine.config import EngineConfig

    cfg = EngineConfig()
    assert (cfg.device, cfg.dtype) == ("auto", "auto")
    cpu, why = cfg.settle_device(cuda=False, checkpoint_dtype="bfloat16")
    assert (cpu.device, cpu.dtype) == ("cpu", "float32")
    assert why == "device cpu (no GPU); dtype float32 (on a CPU)"
    gpu, why = cfg.settle_device(cuda=True, checkpoint_dtype="float32")
    assert (gpu.device, gpu.dtype) == ("cuda", "bfloat16") and "float32" in why
    assert cfg.settle_device(True, "float16")[0].dtype == "float16"
    assert cfg.settle_device(True, None)[0].dtype == "bfloat16"
    assert cfg.settle_device(True, "int8")[0].dtype == "bfloat16"  # not a dtype we run
    given, why = EngineConfig(device="cpu", dtype="bfloat16").settle_device(True, "float16")
    assert (given.device, given.dtype, why) == ("cpu", "bfloat16", "")

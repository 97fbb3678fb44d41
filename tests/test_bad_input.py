"""Bad requests and bad checkpoints get a clear, typed error before anything runs."""

from __future__ import annotations

import shutil

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.config import ModelLoadError
from tests.tiny_models import save_tiny


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_bad_prompts_refused_before_the_batch(smollm2):
    eng = smollm2.engine
    with pytest.raises(InvalidRequestError, match="empty"):
        smollm2.generate([[]], SamplingParams())
    too_long = [5] * (eng.max_model_len + 1)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        smollm2.generate([too_long], SamplingParams())
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        smollm2.generate([[5, 6]], SamplingParams(max_tokens=eng.max_model_len))
    with pytest.raises(InvalidRequestError, match="token ids"):
        smollm2.generate([[1, 10**9]], SamplingParams())
    # A bad request among good ones: the whole call is refused, nothing was queued.
    with pytest.raises(InvalidRequestError):
        smollm2.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not eng.has_unfinished_requests()
    # The engine still serves good requests afterwards.
    assert smollm2.generate("fine", SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_generate_checks_each_request_once(smollm2, monkeypatch):
    """`LLM.generate` checks the whole call before adding any of it, and `add_request` does
    not check those requests again; a request added directly is checked where it is added."""
    from engine.core import engine as engine_module

    calls = []
    check = engine_module.check_request
    monkeypatch.setattr(engine_module, "check_request",
                        lambda *a: calls.append(a[0]) or check(*a))
    smollm2.generate([[5, 6], [7, 8, 9]], SamplingParams(max_tokens=1))
    assert calls == [[5, 6], [7, 8, 9]]
    with pytest.raises(InvalidRequestError):
        smollm2.engine.add_request("direct", [], SamplingParams())
    assert calls[-1] == []


def test_bad_request_does_not_disturb_running_ones(smollm2):
    eng = smollm2.engine
    eng.add_request("good", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    outs = eng.step()
    with pytest.raises(InvalidRequestError):
        eng.add_request("bad", [], SamplingParams())
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].request_id == "good" and outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 4


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model path"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(model=str(tmp_path))


def test_corrupt_and_truncated_checkpoints(tmp_path):
    good = save_tiny(tmp_path / "good", "llama")
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    shard = sorted(truncated.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        LLM(model=str(truncated))

    missing = tmp_path / "missing"
    shutil.copytree(good, missing)
    for f in missing.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(model=str(missing))

    bad_config = tmp_path / "bad_config"
    shutil.copytree(good, bad_config)
    (bad_config / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(model=str(bad_config))

    broken_gguf = tmp_path / "broken.gguf"
    broken_gguf.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="GGUF"):
        LLM(model=str(broken_gguf), cache_dir=tmp_path / "cache")

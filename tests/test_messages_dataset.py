"""The tools tests' sweep (tests/test_tools_dataset.py: the Glaive and BFCL cases of
../shared/maskbench-dev) through the Messages API and the `anthropic` SDK, `tool_choice`
any: every `tool_use` input validates against its `input_schema`, and the message the SDK's
stream helper assembles is the non-streamed one."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

import anthropic
import jsonschema
import pytest

from tests.maskbench import MASKBENCH
from tests.test_tools_dataset import CONCURRENCY, MAX_TOKENS, _selected

if TYPE_CHECKING:
    from tests.conftest import GatewayServer


async def _run_case(client: anthropic.AsyncAnthropic, model: str, sem: asyncio.Semaphore,
                    case: tuple[str, dict[str, dict[str, Any]], bool]) -> dict[str, Any]:
    fname, tools, parallel = case
    kw: dict[str, Any] = {
        "model": model, "max_tokens": MAX_TOKENS,
        "tools": [{"name": n, "input_schema": p} for n, p in tools.items()],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": not parallel},
        "messages": [{"role": "user", "content": f"Call {' or '.join(tools)}."}],
        "extra_body": {"temperature": 0}}
    async with sem:
        try:
            whole = await client.messages.create(**kw)
            async with client.messages.stream(**kw) as s:
                streamed = await s.get_final_message()
        except anthropic.BadRequestError as e:  # a schema no backend compiles
            return {"case": fname, "outcome": "refused", "why": str(e)[:300]}
        except anthropic.APIStatusError as e:
            return {"case": fname, "outcome": "error", "why": str(e)[:300]}
    invalid = []
    calls = [b for b in whole.content if b.type == "tool_use"]
    for call in calls:
        try:
            assert call.name in tools, f"{call.name} was not offered"
            jsonschema.validate(call.input, tools[call.name])
        except (AssertionError, jsonschema.ValidationError) as e:
            invalid.append(str(e)[:300])
    if whole.stop_reason == "max_tokens":  # the stream shows a cut call as far as it came
        streamed_calls = [b for b in streamed.content if b.type == "tool_use"][:len(calls)]
        same = [(b.name, b.input) for b in streamed_calls] == [(b.name, b.input) for b in calls]
    else:
        same = [b.model_dump(exclude={"id"}) for b in streamed.content] == \
            [b.model_dump(exclude={"id"}) for b in whole.content]
    return {"case": fname, "outcome": whole.stop_reason, "invalid": invalid,
            "calls": len(calls), "same": same and streamed.stop_reason == whole.stop_reason}


@pytest.mark.skipif(not MASKBENCH.is_dir(), reason="needs ../shared/maskbench-dev")
def test_tool_inputs_validate_streamed_or_not(gateway_server: GatewayServer) -> None:
    # Every other case of the tools tests' sample (the chat sweep covers the grammar; this
    # one the Messages API's path): SWITCHBOARD_TOOL_CASES selects them all.
    cases = _selected() if os.environ.get("SWITCHBOARD_TOOL_CASES") else _selected()[::2]
    client = anthropic.AsyncAnthropic(base_url=gateway_server.url,
                                      api_key=gateway_server.api_key, max_retries=0,
                                      timeout=600)

    async def run_all() -> list[dict[str, Any]]:
        sem = asyncio.Semaphore(CONCURRENCY // 2)  # each case holds two requests
        return await asyncio.gather(*[_run_case(client, gateway_server.model, sem, c)
                                      for c in cases])

    results = asyncio.run(run_all())
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    print(f"\n{len(results)} Glaive/BFCL cases over /v1/messages: {outcomes}, "
          f"{sum(r.get('calls', 0) for r in results)} tool_use blocks, "
          f"{sum(r.get('same', False) for r in results)} streams the same")
    bad = [r for r in results if r.get("invalid") or r["outcome"] == "error"]
    assert not bad, bad[:5]
    assert set(outcomes) <= {"tool_use", "max_tokens", "refused"}, outcomes
    assert all(r["calls"] >= 1 for r in results if r["outcome"] == "tool_use")
    assert all(r["same"] for r in results if r["outcome"] != "refused"), \
        [r for r in results if not r.get("same", True)][:3]
    assert outcomes.get("tool_use", 0) >= 1

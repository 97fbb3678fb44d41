"""The MaskBench dev set's tool cases (Glaive and BFCL, as tests/test_tools_dataset.py runs
them) with reasoning on: SmolLM2's weights behind the reasoning tokenizer and template
(tests/tiny_models.py), so every reply first reasons (the model never writes `</think>`
itself: the budget ends it), then calls under `tool_choice: "required"`. Every returned call
must name an offered tool and validate; none may fail.

SWITCHBOARD_TOOL_CASES=all (or a number) selects more than the default spread sample.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from tests.conftest import GatewayServer, serve
from tests.test_tools_dataset import CONCURRENCY, DEV, MAX_TOKENS, _selected
from tests.tiny_models import save_reasoning_tokenizer, smollm2_with_tokenizer

BUDGET = 8  # reasoning tokens, the forced end marker included


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[GatewayServer]:
    tmp = tmp_path_factory.mktemp("reasoning-dataset")
    model = smollm2_with_tokenizer(tmp / "smollm2-reasoner", smollm2_dir, save_reasoning_tokenizer)
    with serve(tmp, model=model) as server:
        yield server


async def _run_case(client: AsyncOpenAI, model: str, sem: asyncio.Semaphore, case) -> dict:
    fname, tools, parallel = case
    offered = [
        {"type": "function", "function": {"name": n, "parameters": p}} for n, p in tools.items()
    ]
    async with sem:
        try:
            r = await client.chat.completions.create(
                model=model, tools=offered, tool_choice="required", temperature=0,
                max_tokens=MAX_TOKENS + BUDGET, parallel_tool_calls=parallel,
                messages=[{"role": "user", "content": f"Call {' or '.join(tools)}."}],
                extra_body={"max_reasoning_tokens": BUDGET},
            )
        except openai.BadRequestError as e:  # a schema no backend compiles
            return {"case": fname, "outcome": "refused", "why": str(e)[:300]}
        except openai.InternalServerError as e:  # e.g. the final check refused the output
            return {"case": fname, "outcome": "error", "why": str(e)[:300]}
    choice = r.choices[0]
    invalid = []
    for call in choice.message.tool_calls or []:
        schema = tools.get(call.function.name)
        try:
            assert schema is not None, f"{call.function.name} was not offered"
            jsonschema.validate(json.loads(call.function.arguments), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            invalid.append(str(e)[:300])
    details = r.usage.completion_tokens_details
    return {"case": fname, "outcome": choice.finish_reason, "invalid": invalid,
            "calls": len(choice.message.tool_calls or []),
            "reasoning_tokens": details.reasoning_tokens if details else 0,
            "reasoning": (choice.message.model_extra or {}).get("reasoning_content")}


@pytest.mark.skipif(not DEV.is_dir(), reason="needs ../shared/maskbench-dev")
def test_tool_cases_validate_after_reasoning(server: GatewayServer) -> None:
    cases = _selected()
    client = AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0,
                         timeout=600)

    async def run_all() -> list[dict]:
        sem = asyncio.Semaphore(CONCURRENCY)
        return await asyncio.gather(*[_run_case(client, server.model, sem, c) for c in cases])

    results = asyncio.run(run_all())
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    print(f"\n{len(results)} Glaive/BFCL cases with reasoning: {outcomes}, "
          f"{sum(r.get('calls', 0) for r in results)} calls")
    bad = [r for r in results if r.get("invalid") or r["outcome"] == "error"]
    assert not bad, bad[:5]
    assert set(outcomes) <= {"tool_calls", "length", "refused"}, outcomes
    answered = [r for r in results if r["outcome"] != "refused"]
    assert all(r["reasoning_tokens"] == BUDGET and r["reasoning"] for r in answered)
    assert all(r["calls"] >= 1 for r in results if r["outcome"] == "tool_calls")
    assert outcomes.get("tool_calls", 0) >= 1

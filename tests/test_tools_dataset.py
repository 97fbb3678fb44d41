"""Real-world tool schemas as tools with `tool_choice: "required"`: the Glaive and BFCL cases of
the MaskBench dev set (../shared/maskbench-dev). Every returned call must name an offered tool
and validate against its schema; a call cut by max_tokens must come back as finish_reason
"length" without tool_calls.

For BFCL a case's schema has one top-level property per function (or an `anyOf` of such
objects: several tools): the property name is the function name, its value the parameters.
Names outside ^[a-zA-Z0-9_-]{1,64}$ (BFCL's `math.factorial`) get their other characters
replaced by "_".

A CPU run of all 572 cases takes many minutes (mostly prefill of the tool prompt), so by default
an evenly spread sample runs; SWITCHBOARD_TOOL_CASES=all (or a number) selects more.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import TYPE_CHECKING, Any

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from tests.maskbench import MASKBENCH

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

DEV = MASKBENCH
DEFAULT_CASES = 24
CONCURRENCY = 12  # within the test server's 8 seats + 12 queued
MAX_TOKENS = 64


def tool_cases() -> list[tuple[str, dict[str, dict[str, Any]], bool]]:
    """(file name, {tool name: parameters}, parallel calls allowed) per Glaive/BFCL case."""
    out = []
    for f in sorted(DEV.glob("*.json")):
        if not f.name.startswith(("Glaiveai2K---", "BFCL_")):
            continue
        case = json.loads(f.read_text())
        schema = case["schema"]
        if f.name.startswith("BFCL_"):
            fns = [next(iter(b["properties"].items())) for b in schema.get("anyOf", [schema])]
        else:  # "sample Glaiveai2K/analyze_health_data_4ad104b4.json" -> analyze_health_data
            fns = [(case["description"].split("/")[-1].rsplit("_", 1)[0], schema)]
        tools: dict[str, dict[str, Any]] = {}
        for fname, params in fns:
            name = re.sub(r"[^a-zA-Z0-9_-]", "_", fname)[:60]
            if name in tools and tools[name] != params:
                name = f"{name}_{len(tools)}"
            tools[name] = params
        out.append((f.name, tools, "parallel" in f.name))
    return out


def _selected() -> list[tuple[str, dict[str, dict[str, Any]], bool]]:
    cases = tool_cases()
    want = os.environ.get("SWITCHBOARD_TOOL_CASES", str(DEFAULT_CASES))
    n = len(cases) if want == "all" else min(int(want), len(cases))
    step = len(cases) / max(n, 1)
    return [cases[int(i * step)] for i in range(n)]


async def _run_case(client: AsyncOpenAI, model: str, sem: asyncio.Semaphore, case) -> dict:
    fname, tools, parallel = case
    offered = [
        {"type": "function", "function": {"name": n, "parameters": p}} for n, p in tools.items()
    ]
    async with sem:
        try:
            r = await client.chat.completions.create(
                model=model,
                tools=offered,
                tool_choice="required",
                temperature=0,
                max_tokens=MAX_TOKENS,
                parallel_tool_calls=parallel,
                messages=[{"role": "user", "content": f"Call {' or '.join(tools)}."}],
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
    return {
        "case": fname,
        "outcome": choice.finish_reason,
        "invalid": invalid,
        "calls": len(choice.message.tool_calls or []),
    }


@pytest.mark.skipif(not DEV.is_dir(), reason="needs ../shared/maskbench-dev")
def test_glaive_and_bfcl_calls_always_validate(gateway_server: GatewayServer) -> None:
    cases = _selected()
    client = AsyncOpenAI(
        base_url=gateway_server.base_url, api_key=gateway_server.api_key, max_retries=0, timeout=600
    )

    async def run_all() -> list[dict]:
        sem = asyncio.Semaphore(CONCURRENCY)
        return await asyncio.gather(
            *[_run_case(client, gateway_server.model, sem, c) for c in cases]
        )

    results = asyncio.run(run_all())
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    print(
        f"\n{len(results)} Glaive/BFCL cases: {outcomes}, "
        f"{sum(r.get('calls', 0) for r in results)} calls"
    )
    bad = [r for r in results if r.get("invalid") or r["outcome"] == "error"]
    assert not bad, bad[:5]
    # Never "stop" without a call and never an error; "length" returns only the complete,
    # valid calls before the cut (checked above with the others).
    assert set(outcomes) <= {"tool_calls", "length", "refused"}, outcomes
    assert all(r["calls"] >= 1 for r in results if r["outcome"] == "tool_calls")
    assert outcomes.get("tool_calls", 0) >= 1

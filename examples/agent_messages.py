"""An agent loop through the official `anthropic` SDK and the Messages API: a calculator and a
clock, as examples/agent_tools.py does with the openai SDK.

    make serve                                          # in another terminal
    python examples/agent_messages.py                   # the default question
    python examples/agent_messages.py "What is 17 * 23?"

Each turn the model either calls tools (`tool_use` blocks whose `input` always validates
against the tool's `input_schema`) or answers. The loop runs the calls, sends their results
back as `tool_result` blocks and asks again; after --max-steps rounds it asks for a final
answer with `tool_choice` none. The answer streams (`client.messages.stream`).

The server URL and key come from --base-url / --api-key or ANTHROPIC_BASE_URL /
ANTHROPIC_API_KEY (default http://127.0.0.1:8000, without /v1: the SDK adds /v1/messages; any
key works when the server runs without --api-keys).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import anthropic
from agent_tools import calculator, clock  # the same tools, run the same way

TOOLS = [
    {"name": "calculator",
     "description": "Evaluate an arithmetic expression such as '17 * 23' or '(2 + 3) / 4'.",
     "input_schema": {"type": "object",
                      "properties": {"expression": {"type": "string", "maxLength": 64}},
                      "required": ["expression"], "additionalProperties": False}},
    {"name": "clock", "description": "The current date and time in UTC, ISO 8601.",
     "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}},
]


def run_tool(name: str, args: dict[str, Any]) -> str:
    if name == "calculator":
        return calculator(args["expression"])
    if name == "clock":
        return clock()
    return f"error: unknown tool {name}"


def agent(client: anthropic.Anthropic, model: str, question: str, max_steps: int,
          max_tokens: int) -> str:
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for step in range(max_steps):
        # The first step must use a tool; then the model may call more or answer.
        choice = {"type": "any" if step == 0 else "auto", "disable_parallel_tool_use": True}
        reply = client.messages.create(
            model=model, max_tokens=max_tokens, system="You are a precise assistant. Use the "
            "tools.", messages=messages, tools=TOOLS, tool_choice=choice,
            extra_body={"temperature": 0})
        calls = [b for b in reply.content if b.type == "tool_use"]
        if not calls:
            return "".join(b.text for b in reply.content if b.type == "text")
        messages.append({"role": "assistant", "content": reply.content})
        results = []
        for call in calls:
            result = run_tool(call.name, call.input)
            print(f"  [{call.name}({call.input}) -> {result}]", file=sys.stderr)
            results.append({"type": "tool_result", "tool_use_id": call.id, "content": result})
        messages.append({"role": "user", "content": results})
    with client.messages.stream(model=model, max_tokens=max_tokens, messages=messages,
                                tools=TOOLS, tool_choice={"type": "none"},
                                extra_body={"temperature": 0}) as stream:
        for text in stream.text_stream:
            print(text, end="", flush=True, file=sys.stderr)
        print(file=sys.stderr)
        final = stream.get_final_message()
    return "".join(b.text for b in final.content if b.type == "text")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question", nargs="?", default="What is 12 * 7, and what time is it?")
    ap.add_argument("--base-url", default=os.environ.get("ANTHROPIC_BASE_URL",
                                                         "http://127.0.0.1:8000"))
    ap.add_argument("--api-key", default=os.environ.get("ANTHROPIC_API_KEY", "sk-no-key"))
    ap.add_argument("--model", default=None, help="default: the first model the server lists")
    ap.add_argument("--max-steps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)

    client = anthropic.Anthropic(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    print(agent(client, model, args.question, args.max_steps, args.max_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())

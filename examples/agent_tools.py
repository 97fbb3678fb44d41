"""An agent loop with tools through the official `openai` SDK: a calculator and a clock.

    make serve                                          # in another terminal
    python examples/agent_tools.py                      # the default question
    python examples/agent_tools.py "What is 17 * 23?"

Each turn the model either calls tools (Switchboard guarantees that every call names an
offered tool and that its arguments validate against the tool's schema) or answers. The loop
runs the calls, appends their results as `tool` messages and asks again; after --max-steps
rounds it asks for a final answer with `tool_choice="none"`.

The server URL and key come from --base-url / --api-key or OPENAI_BASE_URL / OPENAI_API_KEY
(default http://127.0.0.1:8000/v1; any key works when the server runs without --api-keys).
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import sys
from datetime import datetime, timezone
from typing import Any

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression such as '17 * 23' or '(2 + 3) / 4'.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "maxLength": 64}},
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "clock",
            "description": "The current date and time in UTC, ISO 8601.",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg,
        ast.UAdd: operator.pos, ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv}


def calculator(expression: str) -> str:
    """Arithmetic only (no names, no calls): a safe evaluator for model-written input."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / % ** are allowed")

    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"


def clock() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")  # noqa: UP017


def run_tool(name: str, arguments: str) -> str:
    args: dict[str, Any] = json.loads(arguments)  # always valid: the server guarantees it
    if name == "calculator":
        return calculator(args["expression"])
    if name == "clock":
        return clock()
    return f"error: unknown tool {name}"


def agent(client: OpenAI, model: str, question: str, max_steps: int, max_tokens: int) -> str:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a precise assistant. Use the tools."},
        {"role": "user", "content": question},
    ]
    for step in range(max_steps + 1):
        last = step == max_steps
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=0,
            parallel_tool_calls=False,
            # The first step must use a tool; then the model may call more or answer.
            tool_choice="none" if last else ("required" if step == 0 else "auto"),
        ).choices[0]
        calls = reply.message.tool_calls or []
        if not calls:
            return reply.message.content or ""
        messages.append(reply.message.model_dump(exclude_none=True))
        for call in calls:
            result = run_tool(call.function.name, call.function.arguments)
            print(f"  [{call.function.name}({call.function.arguments}) -> {result}]",
                  file=sys.stderr)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    raise AssertionError("unreachable: the last step has tool_choice none")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question", nargs="?", default="What is 12 * 7, and what time is it?")
    ap.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL",
                                                         "http://127.0.0.1:8000/v1"))
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "sk-no-key"))
    ap.add_argument("--model", default=None, help="default: the first model the server lists")
    ap.add_argument("--max-steps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    print(agent(client, model, args.question, args.max_steps, args.max_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())

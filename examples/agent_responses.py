"""An agent loop on the Responses API: each turn sends only what is new, chained with
`previous_response_id`, and one function tool (a weather lookup).

    make serve                                          # in another terminal
    python examples/agent_responses.py                  # the default question
    python examples/agent_responses.py "Is it warmer in Oslo or in Rome?"

The server keeps the conversation: a response is a point in a session whose KV stays cached,
so a turn computes only its new tokens (`usage.input_tokens_details.cached_tokens` says how
many were reused). The first turn must call the tool (`tool_choice="required"`: small models
rarely call one unasked); the loop runs the model's function calls, sends their outputs as
`function_call_output` items after the previous response, and stops when the model answers;
after --max-steps rounds it asks for an answer with `tool_choice="none"`.

The server URL and key come from --base-url / --api-key or OPENAI_BASE_URL / OPENAI_API_KEY
(default http://127.0.0.1:8000/v1; any key works when the server runs without --api-keys).
"""

from __future__ import annotations

import argparse
import json
import os

from openai import OpenAI

WEATHER = {"oslo": "4 C, light snow", "rome": "19 C, sunny", "paris": "12 C, cloudy"}
TOOLS = [{
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False},
}]


def get_weather(city: str) -> str:
    return WEATHER.get(city.strip().lower(), "unknown city")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question", nargs="?", default="What is the weather in Oslo and in Rome?")
    ap.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL",
                                                         "http://127.0.0.1:8000/v1"))
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "sk-none"))
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--max-steps", type=int, default=4)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)

    instructions = "You answer weather questions. Call get_weather for each city you need."
    response = client.responses.create(model=args.model, instructions=instructions,
                                       input=args.question, tools=TOOLS, temperature=0,
                                       tool_choice="required", max_output_tokens=128)
    for step in range(args.max_steps + 1):
        calls = [item for item in response.output if item.type == "function_call"]
        usage = response.usage
        cached = usage.input_tokens_details.cached_tokens if usage else 0
        print(f"[step {step}] {response.id}: {len(calls)} call(s), input "
              f"{usage.input_tokens if usage else '?'} tokens, {cached} cached")
        if not calls:
            print(response.output_text)
            return
        outputs = []
        for call in calls:
            result = get_weather(**json.loads(call.arguments))
            print(f"  {call.name}({call.arguments}) -> {result}")
            outputs.append({"type": "function_call_output", "call_id": call.call_id,
                            "output": result})
        last = step == args.max_steps
        response = client.responses.create(
            model=args.model, instructions=instructions, previous_response_id=response.id,
            input=outputs, tools=TOOLS, tool_choice="none" if last else "auto",
            temperature=0, max_output_tokens=128)
    print(response.output_text)


if __name__ == "__main__":
    main()

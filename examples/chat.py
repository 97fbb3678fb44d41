"""Chat with a running Switchboard server through the official `openai` SDK.

    make serve                                   # in another terminal
    python examples/chat.py                      # interactive; empty line or Ctrl-D quits
    python examples/chat.py "Hi!" "And in French?"   # one turn per argument, then exit

The server URL and key come from --base-url / --api-key or OPENAI_BASE_URL / OPENAI_API_KEY
(default http://127.0.0.1:8000/v1; any key works when the server runs without --api-keys).
"""

from __future__ import annotations

import argparse
import os
import sys

from openai import OpenAI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("messages", nargs="*", help="user turns to send (default: read stdin)")
    ap.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL",
                                                         "http://127.0.0.1:8000/v1"))
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "sk-no-key"))
    ap.add_argument("--model", default=None, help="default: the first model the server lists")
    ap.add_argument("--system", default="You are a concise, helpful assistant.")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    history = [{"role": "system", "content": args.system}]
    turns = iter(args.messages) if args.messages else _stdin_turns()
    for user in turns:
        history.append({"role": "user", "content": user})
        print("assistant> ", end="", flush=True)
        reply = []
        stream = client.chat.completions.create(
            model=model,
            messages=history,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    reply.append(choice.delta.content)
                    print(choice.delta.content, end="", flush=True)
        print()
        if usage is not None:
            print(f"  [{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens]",
                  file=sys.stderr)
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _stdin_turns():
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            return
        if not line:
            return
        yield line


if __name__ == "__main__":
    sys.exit(main())

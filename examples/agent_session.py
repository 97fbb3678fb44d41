"""A session-based agent with the official `openai` SDK: the server keeps the history and its
KV cache, so each turn sends only what is new.

    make serve                          # in another terminal
    python examples/agent_session.py    # three tool-result turns, then the stored history

The server URL and key come from --base-url / --api-key or OPENAI_BASE_URL / OPENAI_API_KEY.
"""

from __future__ import annotations

import argparse
import os

import httpx
from openai import OpenAI

SYSTEM = ("You are an operations agent. Tools: search_logs(query) and get_metrics(service). "
          "After each tool result, say in one sentence what you learned.")
TOOL_RESULTS = [
    "search_logs('timeout') -> 12:01 api status=503 ms=900; 12:02 api status=503 ms=870",
    "get_metrics('api') -> p50 40 ms, p99 880 ms, error rate 4.1% (usually 0.2%)",
    "search_logs('deploy api') -> 11:58 deploy api v2.14 by dana",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL",
                                                         "http://127.0.0.1:8000/v1"))
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "sk-no-key"))
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    # The SDK has no sessions resource: create the session with a plain POST.
    http = httpx.Client(base_url=args.base_url,
                        headers={"Authorization": f"Bearer {args.api_key}"}, timeout=300)
    session = http.post("/sessions", json={
        "model": model, "messages": [{"role": "system", "content": SYSTEM}],
        "ttl_seconds": 3600}).json()
    print(f"session {session['id']}")

    for result in TOOL_RESULTS:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Tool result: {result}"}],
            max_tokens=args.max_tokens, temperature=0,
            extra_body={"session_id": session["id"]},  # the server prepends the history
        )
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        print(f"\n> {result}\n{reply.choices[0].message.content}")
        print(f"  [prompt {usage.prompt_tokens} tokens, {cached} served from the session's KV]")

    history = http.get(f"/sessions/{session['id']}").json()["messages"]
    print(f"\nThe session holds {len(history)} messages.")
    http.delete(f"/sessions/{session['id']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

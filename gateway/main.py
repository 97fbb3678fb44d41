"""`switchboard` command line: serve, router, generate, grammar-bench.

The entry point sits on the gateway side: it may import every layer below it.
"""

from __future__ import annotations

import argparse
import json
import sys


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.sampling.params import InvalidRequestError

    llm = LLM(model=args.model)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        out = (
            llm.chat([{"role": "user", "content": args.prompt}], params)
            if args.chat
            else llm.generate(args.prompt, params)
        )[0]
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}
            )
        )
    else:
        print(out.text)
    return 0


def _grammar_bench(args: argparse.Namespace) -> int:
    from engine.config import default_cache_dir
    from engine.runner.loader import resolve_model_dir
    from grammar import bench

    if args.tokenizer is None:
        args.tokenizer = str(resolve_model_dir(None, default_cache_dir()))
    return bench.run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="switchboard")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion offline")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print a JSON object")
    gen.set_defaults(func=_generate)

    from gateway.cli import add_serve_parser
    from gateway.router.cli import add_router_parser
    from grammar import bench

    add_serve_parser(sub)
    add_router_parser(sub)
    gb = sub.add_parser("grammar-bench", help="MaskBench conformance of grammar backends")
    bench.add_arguments(gb)
    gb.set_defaults(func=_grammar_bench)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

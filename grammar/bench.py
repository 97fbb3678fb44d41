"""`switchboard grammar-bench`: MaskBench conformance of the grammar backends.

For each case (a JSON schema with valid and invalid instances): compile the schema through the
GrammarCompiler (capped worker, fallback chain); serialise each instance with
`json.dumps(data, ensure_ascii=False)`, tokenise it without special tokens, and feed the tokens
one at a time, filling the bitmask before each. An instance is accepted when every token is in
the mask and accepted, and the stop token is then allowed and accepted. A case passes when it
compiles, every valid instance is accepted and every invalid one rejected.

A failing case carries a one-line reason (the first token refused, or jsonschema's reason an
accepted instance is invalid, or the backends' errors); `--report` writes them as a Markdown
table (grammar/bench_report.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch
    from transformers import PreTrainedTokenizerBase

    from grammar.backend import CompiledGrammar, Matcher
    from grammar.spec import GrammarError

Status = str  # "pass" | "compile_error" | "timeout" | "validation_error"
CHOICES = ("auto", "xgrammar", "outlines", "llguidance", "llguidance-relaxed")
WINDOW = 2  # compilations submitted ahead of the case being checked


class Instance(TypedDict):
    data: object  # a JSON value
    valid: bool  # whether it satisfies the case's schema


class Case(TypedDict):
    """A MaskBench file."""

    schema: object
    tests: list[Instance]


@dataclass
class CaseResult:
    name: str
    status: Status
    backend: str | None = None  # the backend that compiled it
    compile_ms: float | None = None
    mask_us: list[float] = field(default_factory=list, repr=False)
    detail: str = ""  # why it failed, one line of Markdown (bench_report's reasons)


def case_files(paths: list[str]) -> list[Path]:
    """MaskBench files: the files given, and the *.json files of the folders given, sorted."""
    out: list[Path] = []
    for p in map(Path, paths):
        out += sorted(p.glob("*.json")) if p.is_dir() else [p]
    return out


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the HF folder `path` (`switchboard grammar-bench` passes the embedded
    SmolLM2's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def run_cases(
    files: list[Path],
    tokenizer: PreTrainedTokenizerBase,
    backends: tuple[str, ...],
    timeout_s: float,
    memory_limit_mb: int | None = 2048,
) -> Iterator[CaseResult]:
    """Yield one result per file, in order; compiles run ahead in a capped worker."""
    import torch

    from grammar.compiler import GrammarCompiler
    from grammar.spec import GrammarError, parse_structured_outputs

    with GrammarCompiler(
        tokenizer,
        len(tokenizer),
        backends=backends,
        num_workers=1,
        timeout_s=timeout_s,
        memory_limit_mb=memory_limit_mb,
        cache_size=4 * WINDOW,
    ) as compiler:
        bitmask = torch.zeros(1, (compiler.vocab_size + 31) // 32, dtype=torch.int32)
        stop = compiler.vocab.stop_token_ids[0]

        def submit(path: Path) -> tuple[Case, Future[CompiledGrammar] | GrammarError]:
            case: Case = json.loads(path.read_text())
            try:
                spec = parse_structured_outputs({"json": case["schema"]})
                assert spec is not None  # a json schema always makes a spec
                return case, compiler.submit(spec)
            except GrammarError as e:  # refused before compiling (metaschema, $ref)
                return case, e

        pending = [submit(p) for p in files[:WINDOW]]
        for i, path in enumerate(files):
            case, fut = pending.pop(0)
            if i + WINDOW < len(files):
                pending.append(submit(files[i + WINDOW]))
            yield check_case(path.stem, case, fut, tokenizer, bitmask, stop)


def check_case(
    name: str,
    case: Case,
    fut: Future[CompiledGrammar] | GrammarError,
    tokenizer: PreTrainedTokenizerBase,
    bitmask: torch.Tensor,
    stop: int,
) -> CaseResult:
    from grammar.bench_report import accepted_invalid, refused_valid
    from grammar.spec import GrammarError

    try:
        if isinstance(fut, GrammarError):
            raise fut
        grammar = fut.result()
    except GrammarError as e:
        status = "timeout" if "took over the" in e.message else "compile_error"
        return CaseResult(name, status, detail=e.message)
    result = CaseResult(name, "pass", grammar.backend, grammar.compile_ms)
    for k, test in enumerate(case["tests"]):
        text = json.dumps(test["data"], ensure_ascii=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        at = refused_at(grammar.matcher(), ids, stop, bitmask, result.mask_us)
        if (at is None) != test["valid"]:
            result.status = "validation_error"
            result.detail = (
                accepted_invalid(k, test["data"], text, case["schema"])
                if at is None
                else refused_valid(k, test["data"], text, ids, at, tokenizer, case["schema"])
            )
            break
    return result


def refused_at(
    m: Matcher, ids: list[int], stop: int, bitmask: torch.Tensor, mask_us: list[float]
) -> int | None:
    """Feed `ids` then `stop`, filling the mask before each (timed into `mask_us`). None when
    all are accepted and the matcher terminates (the instance is accepted), else the index in
    `[*ids, stop]` of the first token refused (`len(ids)`: the stop token, the grammar wants
    more)."""
    words = bitmask[0].numpy()  # a view: sees each fill
    for i, t in enumerate([*ids, stop]):
        t0 = time.perf_counter_ns()
        m.fill_bitmask(bitmask, 0)
        mask_us.append((time.perf_counter_ns() - t0) / 1e3)
        if not (int(words[t >> 5]) >> (t & 31)) & 1 or not m.accept(t):
            return i
    return None if m.is_terminated() else len(ids)


def summarize(results: list[CaseResult], backend: str) -> dict[str, object]:
    """The JSON summary: counts by status and p50/p99 of mask and compile times."""
    counts = Counter(r.status for r in results)
    masks = [us for r in results for us in r.mask_us]
    compiles = [r.compile_ms for r in results if r.compile_ms is not None]

    def pct(xs: list[float], q: float) -> float | None:
        return round(float(np.percentile(xs, q)), 3) if xs else None

    return {
        "cases": len(results),
        "passing": counts["pass"],
        "compile_errors": counts["compile_error"],
        "validation_errors": counts["validation_error"],
        "timeouts": counts["timeout"],
        "mask_us_p50": pct(masks, 50),
        "mask_us_p99": pct(masks, 99),
        "compile_ms_p50": pct(compiles, 50),
        "compile_ms_p99": pct(compiles, 99),
        "backend": backend,
        "pass_rate": round(counts["pass"] / len(results), 4) if results else None,
        "compiled_by": dict(Counter(r.backend for r in results if r.backend)),
    }


def print_table(summary: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"grammar-bench ({summary['backend']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key != "backend":
            table.add_row(key, str(value))
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    from grammar.backends import BACKEND_NAMES

    files = case_files(args.cases)[: args.limit]
    if not files:
        print("error: no MaskBench cases found", file=sys.stderr)
        return 2
    backends = BACKEND_NAMES if args.backend == "auto" else (args.backend,)
    if args.tokenizer is None:
        print("error: --tokenizer is required", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(args.tokenizer)
    results: list[CaseResult] = []
    cases = run_cases(files, tokenizer, backends, args.timeout, args.memory_mb or None)
    if args.json:
        progress = None
    else:
        from rich.progress import Progress

        progress = Progress()
        progress.start()
        task = progress.add_task("cases", total=len(files))
    try:
        for r in cases:
            results.append(r)
            if progress:
                progress.update(task, advance=1)
    finally:
        if progress:
            progress.stop()
    if args.report:
        write_report(args.report, results, args.backend)
    summary = summarize(results, args.backend)
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
    return 0


def write_report(path: str, results: list[CaseResult], backend: str) -> None:
    """The failing cases' Markdown table to the file `path` ("-": stdout)."""
    from grammar.bench_report import markdown

    text = markdown(results, backend)
    if path == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("cases", nargs="+", help="MaskBench-format .json files or folders of them")
    p.add_argument("--backend", choices=CHOICES, default="auto", help="auto: the fallback chain")
    p.add_argument("--json", action="store_true", help="print one JSON summary line")
    p.add_argument("--limit", type=int, default=None, help="only the first N cases")
    p.add_argument("--timeout", type=float, default=10.0, help="compile limit per backend, s")
    p.add_argument("--memory-mb", type=int, default=2048, help="compile memory cap (0: none)")
    p.add_argument("--report", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the failing cases, each with a one-line reason, as a Markdown "
                   "table to FILE (no FILE: stdout)")
    p.add_argument("--tokenizer", default=None,
                   help="HF folder of the tokenizer (`switchboard grammar-bench`: the embedded)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grammar-bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

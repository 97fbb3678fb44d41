"""Structured output as an engine stage: compile on admission, mask between logits and the
sampler, advance on postprocess.

Grammars compile in `grammar.GrammarCompiler`'s capped worker subprocesses; a request waits
(`is_ready` false) until its grammar is compiled while the others keep running. Each step the
bitmasks of the masked rows are filled on a helper thread while the forward runs, then
applied to those rows only.

A reasoning request (engine/core/reasoning.py) is gated: while it thinks, its matcher sees no token
and its row only bans the end of the output (a constrained answer must still come); the budget's
last reasoning token is forced to be the end marker; the constraint applies from the first
token after it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from engine.core.request import Request
from grammar.backend import BackendError
from grammar.spec import ConstraintSpec, GrammarError
from grammar.validate import check_output
from kernels.bitmask import apply_token_bitmask_inplace

log = logging.getLogger(__name__)


class GrammarStage:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        # Forced text is encoded by the Rust tokenizer where there is one: transformers'
        # wrapper around it costs more than the encoding (74 against 29 us for a forced run
        # of SmolLM2 on a 2-core CPU), and jump-forward and drafts encode at every step.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._encode: Callable[[str], list[int]] = (
            (lambda text: backend.encode(text, add_special_tokens=False).ids)
            if backend is not None else partial(tokenizer.encode, add_special_tokens=False))
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler: Any = None  # built on first use or `start`: its worker is a subprocess
        self._starting = threading.Lock()
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="grammar-start")
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="bitmask-fill")
        self.jump_forward_tokens = 0  # tokens appended without sampling (metrics)
        self._words = -(-vocab_size // 32)

    def start(self) -> None:
        """Build the compiler now (a server does, before it reports ready), rather than on the
        first constrained request: building it holds the GIL for most of its ~1.3 s, which
        would stall every stream and the engine step meanwhile, and its compile worker then
        imports its backends while nothing waits on it. A compiler that cannot be built (a
        tokenizer without EOS) does not stop the server: its constrained requests fail then,
        each with the reason."""
        try:
            self.compiler  # noqa: B018 - the property builds it
        except Exception as e:  # noqa: BLE001 - reported, and raised again on first use
            log.warning("grammar compiler not started: %s: %s", type(e).__name__, e)

    @property
    def compiler(self):
        """The compiler, built on first use (or by `start`): ~1.3 s (the vocabulary and each
        backend's view of it)."""
        with self._starting:
            if self._compiler is None:
                from grammar.compiler import GrammarCompiler

                self._compiler = GrammarCompiler(
                    self.tokenizer, self.vocab_size, stop_token_ids=self.stop_token_ids
                )
            return self._compiler

    def compile(self, spec: ConstraintSpec) -> Future:
        """Start compiling (or find in the cache); resolves or raises `GrammarError`. Cheap for
        the caller, which may be the event loop: it hashes the spec; the first call builds the
        compiler on a helper thread."""
        if self._compiler is not None:
            return self._compiler.submit(spec)
        out: Future = Future()
        self._starter.submit(_forward, lambda: self.compiler.submit(spec), out)
        return out

    # -- admission ------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        if req.params.constraint is not None:
            req.pending_grammar = self.compile(req.params.constraint)

    @staticmethod
    def is_ready(req: Request) -> bool:
        """The scheduler's predicate: no grammar, or a compiled one (then the matcher exists)."""
        fut = req.pending_grammar
        if fut is None:
            return True
        if not fut.done() or fut.exception() is not None:
            return False
        req.matcher = fut.result().matcher()
        req.pending_grammar = None
        return True

    @staticmethod
    def compile_error(req: Request) -> str | None:
        """Why the request's grammar failed to compile, once it has failed."""
        fut = req.pending_grammar
        if fut is None or not fut.done() or fut.exception() is None:
            return None
        e = fut.exception()
        return e.message if isinstance(e, GrammarError) else f"{type(e).__name__}: {e}"

    # -- the mask stage -------------------------------------------------------------------

    def start_fill(
        self, reqs: list[Request], drafts: dict[Request, tuple[list[int], int]] | None = None
    ) -> Future | None:
        """Fill the bitmask rows of the masked requests among `reqs` (the step's sampling
        rows, in order) on the helper thread; None when none is masked. A request with a draft
        (`drafts`: its tokens and how many lead forced) has consecutive rows, one per drawn
        position (`ScheduledSeq.num_drawn`): each row is masked as if the draft tokens before
        it had been accepted."""
        drafts = drafts or {}
        fillers: list[tuple[int, Callable[[torch.Tensor, int], None]]] = []
        rows: list[int] = []  # every masked row, a draft's later positions included
        for i, r in enumerate(reqs):
            if i and reqs[i - 1] is r:  # a later position of a draft: its first row fills it
                if rows and rows[-1] == i - 1:
                    rows.append(i)
                continue
            f = self._filler_of(r)
            if f is not None:
                draft = drafts.get(r)
                fillers.append((i, partial(_fill_draft, r.matcher, *draft) if draft else f))
                rows.append(i)
        if not fillers:
            return None
        return self._filler.submit(self._fill, fillers, rows, len(reqs))

    def _filler_of(self, req: Request) -> Callable[[torch.Tensor, int], None] | None:
        """What fills the request's row (`fill(bitmask, row)`), decided now, on the engine
        thread; None: the row is not masked."""
        r = req.reasoning
        if r is not None and r.thinking:
            if r.must_end:
                return partial(_only_token, r.fmt.end_id)
            if req.matcher is not None:
                return partial(self._not_ending, req.params.stop_token_ids)
            return None
        return None if req.matcher is None else req.matcher.fill_bitmask

    def _not_ending(self, stop_token_ids: list[int], bitmask: torch.Tensor, row: int) -> None:
        """Every token but those that end the output (EOS, the request's stop ids)."""
        for t in (*self.stop_token_ids, *stop_token_ids):
            if 0 <= t < self.vocab_size:
                bitmask[row, t // 32] &= _int32(~(1 << (t % 32)) & 0xFFFFFFFF)

    def _fill(
        self, fillers: list[tuple[int, Callable[[torch.Tensor, int], None]]], rows: list[int],
        n: int,
    ):
        # Pinned where there is a GPU, so `apply` uploads it without waiting for the forward.
        bitmask = torch.full((n, self._words), -1, dtype=torch.int32,
                             pin_memory=torch.cuda.is_available())  # (rows, vocab / 32)
        errors: dict[int, str] = {}
        for row, fill in fillers:
            try:
                fill(bitmask, row)
            except Exception as e:  # noqa: BLE001 - fails this row's request, not the batch
                errors[row] = f"the grammar backend failed: {type(e).__name__}: {e}"
        # A row that allows nothing (compile-time probes make this rare) is never sampled.
        # One check over the filled rows, not one per row: at 64 rows a step that was 0.6 ms
        # of this thread's time, holding the GIL between ops.
        filled = [row for row, _ in fillers if row not in errors]
        if filled:
            allows = bitmask.index_select(0, torch.tensor(filled)).any(dim=1).tolist()
            for row, ok in zip(filled, allows, strict=True):
                if not ok:
                    errors[row] = ("the grammar allows no next token: the output cannot be "
                                   "completed")
        return bitmask, rows, errors

    @staticmethod
    def apply(logits: torch.Tensor, filled: Future | None) -> dict[int, str]:
        """Mask disallowed tokens of the constrained rows of `logits` [N, V] to -inf; returns
        the rows whose matcher failed (row -> why): their requests must fail."""
        if filled is None:
            return {}
        bitmask, rows, errors = filled.result()
        apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), rows)
        return errors

    # -- postprocess ----------------------------------------------------------------------

    @staticmethod
    def accept(req: Request, token: int) -> str | None:
        """Advance the matcher; an error message if the grammar refuses the token (the mask
        allowed it: a backend defect) or the backend fails on it (a resource limit). Reasoning
        tokens (the end marker included) pass the gate: the matcher never sees them."""
        try:
            if req.matcher is None or _thinking(req) or req.matcher.accept(token):
                return None
        except BackendError as e:
            return f"the grammar backend failed on sampled token {token}: {e}"
        return f"the grammar refused sampled token {token}"

    def jump_forward(self, req: Request, limit: int) -> list[int]:
        """Tokens the grammar forces next (`forced_tokens`), already accepted by the matcher.
        The engine appends these tokens; the next step computes them as one chunk."""
        if req.matcher is None:
            return []
        tokens = self.forced_tokens(req, limit)
        for i, t in enumerate(tokens):
            if not req.matcher.accept(t):
                req.matcher.rollback(i)
                return []
        self.jump_forward_tokens += len(tokens)
        return tokens

    def forced_tokens(self, req: Request, limit: int, with_last: bool = False) -> list[int]:
        """The tokens the grammar forces after the request's last token (at most `limit - 1`),
        the matcher left as it is.

        The forced text is retokenized together with the last token, so the boundary stays
        canonical: if the last token would merge with the forced text, nothing is forced. The
        final forced token is left for the model to sample, since it could merge with what
        follows; `with_last` returns it too (a draft then has the model verify it)."""
        if req.matcher is None or limit <= 1 or _thinking(req):
            return []
        forced = req.matcher.forced_continuation()
        if not forced:
            return []
        last = req.token_ids[-1]
        ids = self._encode(self.tokenizer.decode([last]) + forced)
        if len(ids) < 2 or ids[0] != last:
            return []
        return (ids[1:] if with_last else ids[1:-1])[: limit - 1]

    @staticmethod
    def valid_prefix(req: Request, tokens: list[int]) -> int:
        """How many leading `tokens` the request's grammar allows in a row (all without a
        grammar, none while it reasons); the matcher is left as it was."""
        if req.matcher is None:
            return len(tokens)
        if _thinking(req):
            return 0
        n = 0
        try:
            while n < len(tokens) and req.matcher.accept(tokens[n]):
                n += 1
        finally:
            req.matcher.rollback(n)
        return n

    @staticmethod
    def terminated(req: Request) -> bool:
        return req.matcher is not None and not _thinking(req) and req.matcher.is_terminated()

    @staticmethod
    def check(req: Request, text: str) -> str | None:
        """None if a finished constrained output is valid, else why not. Backends relax some
        keywords (uniqueItems, formats, ...), so this is the last line of defence."""
        if req.params.constraint is None:
            return None
        why = check_output(req.params.constraint, text)
        return None if why is None else f"the constrained output is invalid: {why}"

    def close(self) -> None:
        self._starter.shutdown(wait=True)  # a compiler it is building is then closed below
        self._filler.shutdown(wait=False)
        if self._compiler is not None:
            self._compiler.close()


def _fill_draft(
    matcher: Any, draft: list[int], num_forced: int, bitmask: torch.Tensor, row: int
) -> None:
    """Rows `row..row + len(draft) - num_forced`: the mask after each prefix of `draft` that
    holds its forced tokens (those are not drawn). Rows past a draft token the grammar refuses
    stay unmasked: the draw before them cannot accept that token, so their tokens are never
    used."""
    n = 0
    try:
        for n in range(len(draft) + 1):
            if n >= num_forced:
                matcher.fill_bitmask(bitmask, row + n - num_forced)
            if n == len(draft) or not matcher.accept(draft[n]):
                break
    finally:
        matcher.rollback(n)


def _thinking(req: Request) -> bool:
    return req.reasoning is not None and req.reasoning.thinking


def _int32(bits: int) -> int:
    """32 bits as the signed value an int32 bitmask word holds."""
    return bits - (1 << 32) if bits >= 1 << 31 else bits


def _only_token(token: int, bitmask: torch.Tensor, row: int) -> None:
    bitmask[row] = 0
    bitmask[row, token // 32] = _int32(1 << (token % 32))


def _forward(submit: Callable[[], Future], out: Future) -> None:
    """Resolve `out` as the future that `submit()` returns resolves."""
    try:
        inner = submit()
    except BaseException as e:  # noqa: BLE001 - the caller sees it through `out`
        out.set_exception(e)
        return

    def done(f: Future) -> None:
        if f.cancelled():
            out.cancel()
        elif f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(f.result())

    inner.add_done_callback(done)

"""The overlapped speculative loop's per-step bookkeeping on the device (engine/spec/loop.py),
one kernel each: prompt lookup over every sequence's window, the verify step's inputs, and the
acceptance of the drawn tokens. Triton on CUDA, the torch references elsewhere; each reference
is a few dozen small torch kernels, which on a GPU cost a verify step more time launching and
running than its bookkeeping is worth.

A sequence is a row of `tokens` (S, W) int64, its first `lengths` (S,) entries; the rest of the
row is not read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOOKUP_BLOCK = 1024  # candidate match ends a lookup program compares at once


# --- prompt lookup ---------------------------------------------------------------------------


def prompt_lookup(tokens: torch.Tensor, lengths: torch.Tensor, k: int, min_ngram: int,
                  max_ngram: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.spec.speculative.PromptLookup.propose` for every row at once: (S, k) drafts and (S,)
    how many of them lead that `propose` gives. Triton on CUDA, the torch reference elsewhere."""
    fn = prompt_lookup_triton if tokens.is_cuda else prompt_lookup_torch
    return fn(tokens, lengths, k, min_ngram, max_ngram, window)


def prompt_lookup_torch(tokens: torch.Tensor, lengths: torch.Tensor, k: int, min_ngram: int,
                        max_ngram: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics, per row (`end` its last token's index):
        a candidate is an earlier end i in [max(end - window + 1, 0), end) with
        tokens[i] == tokens[end]; its match length n is how many of tokens[i - j] ==
        tokens[end - j] (j = 0 .. max_ngram - 1) hold in a row, each i - j inside the window.
        The longest match wins, then the latest. Drafts: the k tokens after it, the last token
        repeated past the end (no candidate: the last token k times). `looked`: for a match of
        min_ngram or more, how many drafts come before the end (at most k), else 0.
    """
    width, device = tokens.shape[1], tokens.device
    end = (lengths - 1).unsqueeze(1)  # (S, 1)
    span = min(window, width) - 1  # candidate ends: end - span .. end - 1
    at = end - span + torch.arange(span, device=device)  # (S, span)
    lo = (end - span).clamp(min=0).unsqueeze(2)
    back = at.unsqueeze(2) - torch.arange(max_ngram, device=device)  # (S, span, J)
    earlier = tokens.gather(1, back.clamp(min=0).flatten(1)).view(back.shape)
    suffix = tokens.gather(1, (back[:, -1, :] + 1).clamp(min=0))  # (S, J): end - j
    agree = (earlier == suffix.unsqueeze(1)) & (back >= lo)
    n = leading_true(agree)  # (S, span)
    # longer wins, then later: n in the high digits, the candidate's place in the low ones
    score = n * span + torch.arange(span, device=device)
    best = score.argmax(dim=1, keepdim=True)
    best_len = n.gather(1, best)
    start = torch.where(best_len > 0, at.gather(1, best), end - 1) + 1
    follow = (start + torch.arange(k, device=device)).minimum(end)
    looked = torch.where(best_len >= min_ngram, (end + 1 - start).clamp(max=k), 0)
    return tokens.gather(1, follow), looked.squeeze(1)


def prompt_lookup_triton(tokens: torch.Tensor, lengths: torch.Tensor, k: int, min_ngram: int,
                         max_ngram: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `prompt_lookup_torch`: one program per row."""
    rows = tokens.shape[0]
    drafts = tokens.new_empty(rows, k)
    looked = tokens.new_empty(rows)
    span = min(window, tokens.shape[1]) - 1
    _lookup_kernel[(rows,)](
        tokens, lengths, drafts, looked, tokens.stride(0), span, k, min_ngram,
        J=max_ngram, K_PAD=triton.next_power_of_2(k), BLOCK=LOOKUP_BLOCK,
    )
    return drafts, looked


@triton.jit
def _lookup_kernel(
    tok_ptr, len_ptr, drafts_ptr, looked_ptr, s_tok, span, k, min_ngram,
    J: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    seq = tok_ptr + row.to(tl.int64) * s_tok
    end = tl.load(len_ptr + row) - 1
    lo = tl.maximum(end - span, 0)
    # score = n * 2**32 + i: the longest match, then the latest; -1: none
    best = tl.full((), -1, tl.int64)
    for start in range(lo, end, BLOCK):
        i = start + tl.arange(0, BLOCK)
        run = i < end
        n = tl.zeros((BLOCK,), tl.int64)
        for j in tl.static_range(J):
            run = run & (i - j >= lo)
            earlier = tl.load(seq + i - j, mask=run, other=-1)
            last = tl.load(seq + tl.maximum(end - j, 0))
            run = run & (earlier == last)
            n += run.to(tl.int64)
        score = tl.where(n > 0, n * 4294967296 + i, -1)
        best = tl.maximum(best, tl.max(score, axis=0))
    best_len = tl.where(best >= 0, best // 4294967296, 0)
    first = tl.where(best >= 0, best % 4294967296 + 1, end)  # the first draft's index
    d = tl.arange(0, K_PAD)
    drafts = tl.load(seq + tl.minimum(first + d, end))
    tl.store(drafts_ptr + row * k + d, drafts, mask=d < k)
    looked = tl.where(best_len >= min_ngram, tl.minimum(end + 1 - first, k), 0)
    tl.store(looked_ptr + row, looked)


def leading_true(x: torch.Tensor) -> torch.Tensor:
    """How many entries lead each row of bool `x` (its last dim) before the first False: the
    first False's index, a False appended. (torch's cumprod over a short last dim is a slow
    scan on CUDA.)"""
    ended = torch.cat([x, x.new_zeros(*x.shape[:-1], 1)], dim=-1).logical_not_()
    return ended.to(torch.uint8).argmax(dim=-1)


# --- the verify step's inputs ----------------------------------------------------------------


def verify_inputs(tokens: torch.Tensor, lengths: torch.Tensor, prompt_lens: torch.Tensor,
                  drafts: torch.Tensor, tables: torch.Tensor, page_size: int
                  ) -> tuple[torch.Tensor, ...]:
    """A verify step of each row's last token and its k drafts, flattened (S * (1 + k),):
    input ids, positions, KV slots (from `tables` (S, P) int32), each position's index in its
    request's output (the sampler's noise key); and (S,) int32 context lengths once the step
    ran. Triton on CUDA, the torch reference elsewhere."""
    fn = verify_inputs_triton if tokens.is_cuda else verify_inputs_torch
    return fn(tokens, lengths, prompt_lens, drafts, tables, page_size)


def verify_inputs_torch(tokens, lengths, prompt_lens, drafts, tables, page_size):
    q = drafts.shape[1] + 1
    within = torch.arange(q, device=tokens.device)
    last = (lengths - 1).unsqueeze(1)  # not in the KV yet: the step computes it first
    positions = last + within
    ids = torch.cat([tokens.gather(1, last), drafts], dim=1)
    slots = tables.long().gather(1, positions // page_size) * page_size + positions % page_size
    outputs = (lengths - prompt_lens).unsqueeze(1) + within
    lens = (lengths + q - 1).int()
    return ids.flatten(), positions.flatten(), slots.flatten(), outputs.flatten(), lens


def verify_inputs_triton(tokens, lengths, prompt_lens, drafts, tables, page_size):
    rows, k = drafts.shape
    q = k + 1
    ids, positions, slots, outputs = (tokens.new_empty(rows * q) for _ in range(4))
    lens = lengths.new_empty(rows, dtype=torch.int32)
    _inputs_kernel[(rows,)](
        tokens, lengths, prompt_lens, drafts, tables, ids, positions, slots, outputs, lens,
        tokens.stride(0), tables.stride(0), k, PAGE=page_size, Q_PAD=triton.next_power_of_2(q),
    )
    return ids, positions, slots, outputs, lens


@triton.jit
def _inputs_kernel(
    tok_ptr, len_ptr, plen_ptr, drafts_ptr, tables_ptr, ids_ptr, pos_ptr, slot_ptr, out_ptr,
    lens_ptr, s_tok, s_tab, k, PAGE: tl.constexpr, Q_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    j = tl.arange(0, Q_PAD)
    real = j <= k
    length = tl.load(len_ptr + row)
    pos = length - 1 + j
    last = tl.load(tok_ptr + row.to(tl.int64) * s_tok + length - 1)
    draft = tl.load(drafts_ptr + row * k + j - 1, mask=real & (j > 0), other=0)
    page = tl.load(tables_ptr + row * s_tab + pos // PAGE, mask=real, other=0).to(tl.int64)
    at = row * (k + 1) + j
    tl.store(ids_ptr + at, tl.where(j == 0, last, draft), mask=real)
    tl.store(pos_ptr + at, pos, mask=real)
    tl.store(slot_ptr + at, page * PAGE + pos % PAGE, mask=real)
    tl.store(out_ptr + at, pos + 1 - tl.load(plen_ptr + row), mask=real)
    tl.store(lens_ptr + row, (length + k).to(tl.int32))


# --- acceptance ------------------------------------------------------------------------------


def accept(tokens: torch.Tensor, lengths: torch.Tensor, drafts: torch.Tensor,
           drawn: torch.Tensor) -> None:
    """In place: each row's drafts equal to the token drawn at their position are accepted, up
    to the first that differs; the drawn tokens (S, 1 + k) are written past each row (those
    after the accepted ones are never read) and its length grows by the accepted drafts and
    the token after them. A drawn -1 (a row that could not be sampled) is written as 0. Triton
    on CUDA, the torch reference elsewhere."""
    fn = accept_triton if tokens.is_cuda else accept_torch
    fn(tokens, lengths, drafts, drawn)


def accept_torch(tokens, lengths, drafts, drawn) -> None:
    q = drawn.shape[1]
    drawn = drawn.clamp(min=0)
    accepted = leading_true(drawn[:, : q - 1] == drafts)
    tokens.scatter_(1, lengths.unsqueeze(1) + torch.arange(q, device=tokens.device), drawn)
    lengths += accepted + 1


def accept_triton(tokens, lengths, drafts, drawn) -> None:
    rows, q = drawn.shape
    _accept_kernel[(rows,)](tokens, lengths, drafts, drawn, tokens.stride(0), q - 1,
                            Q_PAD=triton.next_power_of_2(q))


@triton.jit
def _accept_kernel(tok_ptr, len_ptr, drafts_ptr, drawn_ptr, s_tok, k, Q_PAD: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, Q_PAD)
    drawn = tl.maximum(tl.load(drawn_ptr + row * (k + 1) + j, mask=j <= k, other=0), 0)
    draft = tl.load(drafts_ptr + row * k + j, mask=j < k, other=-1)
    miss = (drawn != draft) | (j >= k)
    accepted = tl.min(tl.where(miss, j, Q_PAD), axis=0)
    length = tl.load(len_ptr + row)
    tl.store(tok_ptr + row.to(tl.int64) * s_tok + length + j, drawn, mask=j <= k)
    tl.store(len_ptr + row, length + accepted + 1)


def warm_up(device: torch.device, k: int, page_size: int) -> None:
    """Compile the three kernels for `k` drafts (Triton compiles on a kernel's first call):
    a serving engine does it at start, not in its first speculative step."""
    if device.type != "cuda":
        return
    # Rows as wide as the loop's (a multiple of 256): Triton specializes a kernel on whether
    # each integer argument (a row's stride, the lookup's span) divides by 16, so a narrower
    # row would compile other variants than the loop then runs.
    tokens = torch.arange(256, device=device).remainder(8).repeat(2, 1)
    lengths = torch.full((2,), 8, device=device)
    drafts, _ = prompt_lookup_triton(tokens, lengths, k, 2, 4, 4096)
    tables = torch.zeros(2, -(-(8 + k) // page_size), dtype=torch.int32, device=device)
    ids = verify_inputs_triton(tokens, lengths, lengths // 2, drafts, tables, page_size)[0]
    accept_triton(tokens, lengths, drafts, ids.view(2, k + 1))
    torch.cuda.synchronize(device)

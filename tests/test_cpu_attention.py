"""The CPU decode path (`kernels.cpu_attention`) against the per-row definition of decode
attention, and the grouping of rows by context length."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu_attention
from kernels.cpu_attention import DecodePlan, _groups
from kernels.paged_attention import paged_decode_torch


def _reference(q, k, v, tables, lens, page_size, scale):
    """The definition, one row and one head at a time."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for b, n in enumerate(lens.tolist()):
        slots = [int(tables[b, j // page_size]) * page_size + j % page_size for j in range(n)]
        for h in range(q.shape[1]):
            kh, vh = k[slots, h // group], v[slots, h // group]
            out[b, h] = torch.softmax(scale * kh @ q[b, h], dim=0) @ vh
    return out


def _batch(seed: int, rows: int, kv_heads: int, heads: int, page_size: int, max_len: int):
    """A pool whose free slots hold NaN (a previous owner's), pages handed out shuffled,
    tables padded with page 0."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dim = 16
    lens = [rng.randint(1, max_len) for _ in range(rows)]
    pages = [-(-n // page_size) for n in lens]
    ids = list(range(1, sum(pages) + 1))
    rng.shuffle(ids)
    width = max(pages)
    tables, at = [], 0
    for p in pages:
        tables.append(ids[at : at + p] + [0] * (width - p))
        at += p
    k = torch.full(((sum(pages) + 1) * page_size, kv_heads, dim), float("nan"))
    v = k.clone()
    for row, n in enumerate(lens):
        slots = [tables[row][j // page_size] * page_size + j % page_size for j in range(n)]
        k[slots], v[slots] = torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    q = torch.randn(rows, heads, dim)
    return (q, k, v, torch.tensor(tables, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32), page_size, dim**-0.5)


@pytest.mark.parametrize("seed,rows,kv_heads,heads,page_size,max_len", [
    (0, 1, 1, 1, 4, 9),
    (1, 7, 2, 6, 4, 40),
    (2, 24, 3, 9, 16, 500),
    (3, 40, 4, 4, 8, 300),
])
def test_plan_equals_the_definition(seed, rows, kv_heads, heads, page_size, max_len) -> None:
    q, k, v, tables, lens, page_size, scale = _batch(seed, rows, kv_heads, heads, page_size,
                                                     max_len)
    plan = DecodePlan(tables, lens, page_size, kv_heads, q.shape[2], q.dtype)
    assert sorted(torch.cat([g.rows for g in plan.groups]).tolist()) == list(range(rows))
    # A strided view of a larger output, as the model passes its decode rows.
    full = torch.full((rows + 3, heads, q.shape[2]), float("nan"))
    out = full[:rows]
    plan.attend(q, k, v, scale, out)
    want = _reference(q, k, v, tables, lens, page_size, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.isnan(full[rows:]).all()  # nothing past the decode rows is written
    ref = torch.empty_like(q)
    paged_decode_torch(q, k, v, tables, lens, page_size, scale, ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # Every layer of a step reuses the plan (and its buffers): same inputs, same outputs.
    again = torch.empty_like(q)
    plan.attend(q, k, v, scale, again)
    assert torch.equal(again, out)


def test_rows_are_grouped_by_length_when_padding_costs_more_than_a_group() -> None:
    page = 16
    # Nine short rows and one long one: padding the short ones to 4096 slots costs far more
    # than a second group.
    runs = _groups(sorted([16] * 9 + [4096]), page)
    assert runs == [(0, 9), (9, 10)]
    # Rows of about one length stay one group.
    assert _groups([300, 310, 320, 320], page) == [(0, 4)]
    # The cuts are optimal: no partition into runs costs less (all of them, for 8 rows).
    rng = random.Random(0)
    lens = sorted(rng.randint(1, 2000) for _ in range(8))

    def cost(cuts):
        return sum((b - a) * -(-lens[b - 1] // page) * page + cpu_attention.GROUP_COST
                   for a, b in cuts)

    best = min(cost(list(zip([0, *c], [*c, 8], strict=True)))
               for mask in range(2**7)
               for c in [[i + 1 for i in range(7) if mask >> i & 1]])
    assert cost(_groups(lens, page)) == best


@pytest.mark.parametrize("n, ctx, heads, kv_heads", [(1, 7, 4, 4), (5, 300, 9, 3), (37, 64, 8, 1)])
def test_chunk_over_a_cached_context_matches_sdpa(n: int, ctx: int, heads: int,
                                                  kv_heads: int) -> None:
    """`attend_chunk` (a verify step's or a prefill chunk's queries over their cached context)
    against SDPA with the same causal mask."""
    from kernels.cpu_attention import attend_chunk

    g = torch.Generator().manual_seed(n * ctx)
    q = torch.randn(n, heads, 32, generator=g)
    k, v = (torch.randn(kv_heads, ctx, 32, generator=g) for _ in range(2))
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask, scale=0.2, enable_gqa=heads > kv_heads)
    torch.testing.assert_close(attend_chunk(q, k, v, mask, 0.2), want.transpose(0, 1),
                               rtol=1e-5, atol=1e-5)

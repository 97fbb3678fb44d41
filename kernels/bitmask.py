"""Token-bitmask apply: the grammar's mask stage between the logits and the sampler.

Bit `v % 32` of word `v // 32` in a bitmask row is set iff token `v` is allowed (xgrammar's
layout). Disallowed tokens get a logit of -inf, so no sampler can pick them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def apply_token_bitmask_inplace(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int] | None = None
) -> None:
    """Set logits of tokens disallowed by `bitmask` to -inf, in place.

    Args:
        logits: [B, V] float (fp32, bf16 or fp16).
        bitmask: [B, ceil(V / 32)] int32, on the same device.
        indices: the rows to mask (each row `b` uses `bitmask[b]`); None: every row.
    """
    if logits.device.type == "cpu":
        apply_token_bitmask_inplace_torch(logits, bitmask, indices)
    else:
        apply_token_bitmask_inplace_triton(logits, bitmask, indices)


def apply_token_bitmask_inplace_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int] | None = None
) -> None:
    """The reference.

    Semantics:
        B, V = logits.shape
        for b in (range(B) if indices is None else indices):
            for v in range(V):
                if (bitmask[b, v // 32] >> (v % 32)) & 1 == 0:
                    logits[b, v] = -inf
    """
    _check(logits, bitmask, indices)
    vocab = logits.shape[1]
    rows = torch.arange(logits.shape[0]) if indices is None else torch.tensor(indices).long()
    rows = rows.to(logits.device)
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[rows].unsqueeze(-1) >> shifts) & 1  # (R, W, 32)
    disallowed = (bits == 0).flatten(1)[:, :vocab]  # (R, V)
    logits[rows] = logits[rows].masked_fill(disallowed, float("-inf"))


def apply_token_bitmask_inplace_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int] | None = None
) -> None:
    """Triton version of `apply_token_bitmask_inplace_torch` (same contract)."""
    _check(logits, bitmask, indices)
    batch, vocab = logits.shape
    if indices is None:
        rows, num_rows = logits, batch  # a placeholder pointer; HAS_INDICES is off
    else:
        host = torch.tensor(indices, dtype=torch.int32, pin_memory=logits.is_cuda)
        rows = host.to(logits.device, non_blocking=True)  # no wait on the forward
        num_rows = len(indices)
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(vocab, _BLOCK))
    _apply_bitmask_kernel[grid](
        logits,
        bitmask,
        rows,
        vocab,
        logits.stride(0),
        bitmask.stride(0),
        HAS_INDICES=indices is not None,
        BLOCK=_BLOCK,
    )


_BLOCK = 4096


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    indices_ptr,
    vocab,
    logits_stride,
    bitmask_stride,
    HAS_INDICES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per (row, BLOCK tokens); only disallowed positions are written.
    if HAS_INDICES:
        row = tl.load(indices_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    words = tl.load(bitmask_ptr + row * bitmask_stride + offs // 32, mask=in_vocab, other=-1)
    allowed = (words >> (offs % 32)) & 1
    neg_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + offs, neg_inf, mask=in_vocab & (allowed == 0))


def _check(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int] | None) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"need 2-D logits and bitmask, got {logits.shape} and {bitmask.shape}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask on {bitmask.device} but logits on {logits.device}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    batch, vocab = logits.shape
    if bitmask.shape != (batch, (vocab + 31) // 32):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not fit logits {(batch, vocab)}")
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    if indices is not None and any(not 0 <= i < batch for i in indices):
        raise ValueError(f"indices {indices} out of range for batch {batch}")

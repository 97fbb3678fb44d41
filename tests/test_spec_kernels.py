"""The speculative loop's kernels (kernels/spec_decode.py): Triton against the torch references
(Triton's interpreter on CPU, compiled on a GPU), and the lookup reference against the host's
`PromptLookup.propose`."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

from engine.spec.speculative import PromptLookup  # noqa: E402
from kernels import spec_decode as sd  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _sequences(g: torch.Generator, rows: int, vocab: int, width: int, longest: int):
    """Random rows over a small vocabulary (many matches, many ties), garbage past each."""
    lengths = torch.randint(1, longest + 1, (rows,), generator=g)
    tokens = torch.full((rows, width), 99)  # past a sequence's length: never read
    for i, n in enumerate(lengths.tolist()):
        tokens[i, :n] = torch.randint(0, vocab, (n,), generator=g)
    return tokens, lengths


@pytest.mark.parametrize("window,k,max_ngram", [(4096, 4, 4), (7, 1, 4), (12, 3, 2),
                                                (2048, 5, 3)])
def test_lookup_matches_the_host_lookup(window, k, max_ngram):
    """The reference gives each row `propose`'s drafts first (`looked` of them), then fillers
    from the sequence; the Triton kernel gives the reference's, over windows shorter and
    longer than the rows and sequences longer than one kernel block."""
    g = torch.Generator().manual_seed(window + k)
    lookup = PromptLookup(min_ngram=2, max_ngram=max_ngram, window=window)
    tokens, lengths = _sequences(g, 64, 5, 48, 40)
    long_tokens, long_lengths = _sequences(g, 4, 3, 3000, 3000)  # > LOOKUP_BLOCK
    matched = 0
    for toks, lens in ((tokens, lengths), (long_tokens, long_lengths)):
        drafts, looked = sd.prompt_lookup_torch(toks, lens, k, 2, max_ngram, window)
        assert drafts.shape == (len(lens), k)
        for i, n in enumerate(lens.tolist()):
            want = lookup.propose(toks[i, :n].tolist(), k)
            assert int(looked[i]) == len(want)
            assert drafts[i, : len(want)].tolist() == want
            assert int(drafts[i].max()) < 5
        matched += int(looked.count_nonzero())
        got = sd.prompt_lookup_triton(toks.to(DEVICE), lens.to(DEVICE), k, 2, max_ngram, window)
        assert torch.equal(got[0].cpu(), drafts) and torch.equal(got[1].cpu(), looked)
    assert matched > 8  # the comparison covered matches


def test_verify_inputs_match_the_reference():
    g = torch.Generator().manual_seed(1)
    rows, k, page = 6, 4, 4
    tokens, lengths = _sequences(g, rows, 50, 64, 40)
    prompt_lens = (lengths // 2).clamp(min=1)
    drafts = torch.randint(0, 50, (rows, k), generator=g)
    tables = torch.randperm(200, generator=g)[: rows * 12].view(rows, 12).int()
    want = sd.verify_inputs_torch(tokens, lengths, prompt_lens, drafts, tables, page)
    got = sd.verify_inputs_triton(*(t.to(DEVICE) for t in (tokens, lengths, prompt_lens, drafts,
                                                           tables)), page)
    for w, o in zip(want, got, strict=True):
        assert w.dtype == o.dtype and torch.equal(w, o.cpu())
    ids = want[0].view(rows, k + 1)
    assert ids[:, 0].tolist() == [int(tokens[i, n - 1]) for i, n in enumerate(lengths)]
    assert torch.equal(ids[:, 1:], drafts)
    # The last position of row 0, by hand: its page from the table, the offset in it.
    pos = int(lengths[0]) - 1 + k
    assert int(want[2][k]) == int(tables[0, pos // page]) * page + pos % page


def test_accept_matches_the_reference():
    g = torch.Generator().manual_seed(2)
    rows, k = 8, 4
    tokens, lengths = _sequences(g, rows, 7, 64, 40)
    drafts = torch.randint(0, 3, (rows, k), generator=g)
    drawn = torch.randint(0, 3, (rows, k + 1), generator=g)
    drawn[0, :k] = drafts[0]  # every draft accepted
    drawn[1, 0] = (drafts[1, 0] + 1) % 3  # none
    drawn[2, 1] = -1  # a row that could not be sampled
    want_tokens, want_lengths = tokens.clone(), lengths.clone()
    sd.accept_torch(want_tokens, want_lengths, drafts, drawn)
    assert int(want_lengths[0] - lengths[0]) == k + 1
    assert int(want_lengths[1] - lengths[1]) == 1
    got_tokens, got_lengths = tokens.to(DEVICE), lengths.to(DEVICE)
    sd.accept_triton(got_tokens, got_lengths, drafts.to(DEVICE), drawn.to(DEVICE))
    assert torch.equal(got_tokens.cpu(), want_tokens)
    assert torch.equal(got_lengths.cpu(), want_lengths)


@pytest.mark.gpu
def test_kernels_at_serving_shapes():
    """A batch-16 loop step of an 8B model's shapes: 16 sequences of up to 8k tokens over a
    128k vocabulary, each with a planted repeat for the lookup to find, the default window,
    k = 4, 16-token pages: the compiled kernels give the references'."""
    g = torch.Generator().manual_seed(3)
    rows, k, page, width = 16, 4, 16, 9216
    tokens, lengths = _sequences(g, rows, 128256, width, 8192)
    for i, n in enumerate(lengths.tolist()):
        if n > 64:  # a stretch copied from earlier in the sequence ends it
            tokens[i, n - 8 : n] = tokens[i, n // 2 : n // 2 + 8]
    prompt_lens = (lengths // 2).clamp(min=1)
    tables = torch.randperm(16 * 600, generator=g)[: rows * 577].view(rows, 577).int()
    on = [t.cuda() for t in (tokens, lengths, prompt_lens, tables)]
    drafts, looked = sd.prompt_lookup_torch(tokens, lengths, k, 2, 4, 4096)
    got = sd.prompt_lookup_triton(on[0], on[1], k, 2, 4, 4096)
    assert torch.equal(got[0].cpu(), drafts) and torch.equal(got[1].cpu(), looked)
    assert int(looked.count_nonzero()) > rows // 2
    want = sd.verify_inputs_torch(tokens, lengths, prompt_lens, drafts, tables, page)
    got_inputs = sd.verify_inputs_triton(on[0], on[1], on[2], drafts.cuda(), on[3], page)
    assert all(torch.equal(w, o.cpu()) for w, o in zip(want, got_inputs, strict=True))
    drawn = torch.where(torch.rand(rows, k + 1, generator=g) < 0.5,
                        torch.cat([drafts, drafts[:, :1]], dim=1), 7)
    sd.accept_torch(tokens, lengths, drafts, drawn)
    sd.accept_triton(on[0], on[1], drafts.cuda(), drawn.cuda())
    assert torch.equal(on[0].cpu(), tokens) and torch.equal(on[1].cpu(), lengths)

"""The sampler against the definitions: each parameter's semantics against a plain per-row
reference written here, the draws against the distribution (chi-square), seeds across batch
shapes. CPU, milliseconds to a second each."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.core.request import Request
from engine.sampling.counter_rng import hash32, mix, open_uniform
from engine.sampling.params import InvalidRequestError, SamplingParams
from engine.sampling.sampler import Sampler

EOS = 2
NEG = float("-inf")
# chi-square critical values at significance 1e-3, by degrees of freedom
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def request(rid: str = "r", prompt: list[int] | None = None, outputs=(), **kw) -> Request:
    r = Request(rid, list(prompt or [1]), SamplingParams(**kw))
    r.token_ids.extend(outputs)
    return r


# -- the reference: the definitions, one row at a time ----------------------------------


def ref_logits(row: torch.Tensor, req: Request, eos: list[int]) -> torch.Tensor:
    """Logit bias, repetition penalty (prompt and output tokens), presence and frequency
    penalties (output tokens), min_tokens bans."""
    p, row = req.params, row.clone()
    for t, b in p.logit_bias.items():
        row[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(req.token_ids):
            rp = p.repetition_penalty
            row[t] = row[t] / rp if row[t] > 0 else row[t] * rp
    out = req.output_token_ids
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    if req.num_output_tokens < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            if t < len(row):
                row[t] = NEG
    return row


def ref_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution of a draw: temperature; the top_k best (ties: lower id first); of
    those, each token while the mass strictly before it is below top_p (the first always);
    of those, each token with probability at least min_p times the best. Renormalized."""
    if p.greedy:
        return torch.nn.functional.one_hot(row.argmax(), len(row)).double()
    probs = torch.softmax(row.double() / p.temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: (-probs[t], t))
    kept = order[: p.top_k] if p.top_k > 0 else order
    z = sum(probs[t] for t in kept)
    mass, nucleus = 0.0, []
    for t in kept:
        if nucleus and mass >= p.top_p:
            break
        nucleus.append(t)
        mass += probs[t] / z
    best = probs[nucleus[0]]
    out = torch.zeros(len(probs), dtype=torch.float64)
    for t in nucleus:
        if probs[t] >= p.min_p * best:
            out[t] = probs[t]
    return out / out.sum()


# -- semantics ----------------------------------------------------------------------------

GRID = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=1.7, min_p=0.1),
    dict(top_k=3),
    dict(top_k=1, temperature=2.0),
    dict(top_p=0.6),
    dict(top_p=0.9, temperature=0.7),
    dict(top_k=5, top_p=0.8, min_p=0.05, temperature=0.8),
    dict(top_k=40),  # past the vocabulary: off
]


@pytest.mark.parametrize("combo", ["alone", "all", "top_k_rows"])
def test_distribution_matches_the_definitions(combo):
    """Every batch path (whole vocabulary, top max(k), full sort) gives each row the reference
    distribution."""
    gen = torch.Generator().manual_seed(0)
    grid = {"alone": GRID, "all": GRID, "top_k_rows": [g for g in GRID if "top_k" in g]}[combo]
    sampler = Sampler(seed=0)
    for trial in range(4):
        logits = torch.randn(len(grid), 24, generator=gen) * 2
        logits[:, 5] = logits[:, 6]  # a tie in every row
        reqs = [request(f"r{i}", **kw) for i, kw in enumerate(grid)]
        if combo == "alone":
            got = torch.cat([sampler.distribution(logits[i : i + 1], [r])
                             for i, r in enumerate(reqs)])
        else:
            got = sampler.distribution(logits, reqs)
        for i, r in enumerate(reqs):
            want = ref_probs(logits[i], r.params)
            assert torch.allclose(got[i].double(), want, atol=1e-6), (grid[i], trial)


def test_filters_on_a_known_row():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    sampler = Sampler()

    def support(**kw):
        return (sampler.distribution(logits, [request(**kw)])[0] > 0).int().tolist()

    assert support(top_k=2) == [1, 1, 0, 0, 0]
    assert support(top_p=0.8) == [1, 1, 1, 0, 0]  # 0.5 + 0.2 < 0.8: 0.15 still needed
    assert support(min_p=0.3) == [1, 1, 1, 0, 0]
    assert support(top_k=4, top_p=0.5 / 0.95 - 1e-3) == [1, 0, 0, 0, 0]  # of the top-4 mass
    p = sampler.distribution(logits, [request(top_k=2)])[0]
    assert torch.allclose(p[:2], torch.tensor([0.5, 0.2]) / 0.7)


@pytest.mark.parametrize("extra", [{}, {"top_k": 4}])
def test_top_p_ties_keep_the_lower_ids(extra):
    """Equal probabilities rank by token id, on the sort path and the top-k path."""
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.2, 0.2, 0.3]]))
    sampler = Sampler()
    p = sampler.distribution(logits, [request(top_p=0.45, **extra)])[0]
    assert (p > 0).int().tolist() == [0, 1, 0, 0, 1]
    p = sampler.distribution(logits, [request(top_p=0.6, **extra)])[0]
    assert (p > 0).int().tolist() == [0, 1, 1, 0, 1]
    p = sampler.distribution(logits, [request(top_k=2)])[0]
    assert (p > 0).int().tolist() == [0, 1, 0, 0, 1]


def test_adjustments_match_the_definitions():
    """Bias, penalties and bans, read back through logprobs (the model's distribution after
    them, before temperature) of every token."""
    gen = torch.Generator().manual_seed(1)
    v = 16
    prompt, outputs = [3, 4, 4, 9], [4, 7, 7, 7, 12]
    cases = [
        dict(logit_bias={1: 3.0, 15: -2.5}),
        dict(presence_penalty=1.5),
        dict(frequency_penalty=0.7),
        dict(presence_penalty=-0.5, frequency_penalty=1.2, repetition_penalty=1.3),
        dict(repetition_penalty=0.8, logit_bias={4: 1.0}),
        dict(min_tokens=8, max_tokens=10, stop_token_ids=[11, 99]),  # 99: past the vocabulary
        dict(min_tokens=8, max_tokens=10, ignore_eos=True, stop_token_ids=[11]),
        dict(min_tokens=5, max_tokens=10, stop_token_ids=[11]),  # reached: nothing banned
        dict(temperature=0.3, top_k=2, logit_bias={0: 100.0}),
        dict(),
    ]
    logits = torch.randn(len(cases), v, generator=gen) * 3
    reqs = [request(f"r{i}", prompt, outputs, logprobs=v, **kw) for i, kw in enumerate(cases)]
    out = Sampler(eos_token_ids=[EOS])(logits.clone(), reqs)
    for i, r in enumerate(reqs):
        want = torch.log_softmax(ref_logits(logits[i], r, [EOS]), dim=-1)
        got = torch.full((v,), NEG)
        for t, lp in out[i].logprob.top:
            got[t] = lp
        assert torch.allclose(got, want, atol=1e-5), cases[i]
        assert out[i].logprob.logprob == pytest.approx(float(want[out[i].token_id]))
        assert [t for t, _ in out[i].logprob.top[:3]] == want.topk(3).indices.tolist()


def test_repetition_penalty_counts_the_prompt_from_the_first_token():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    r = request(prompt=[0, 3], temperature=0, repetition_penalty=1.2)
    assert Sampler()(logits.clone(), [r])[0].token_id == 1  # 2.0 / 1.2 < 1.9


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 0.5]])  # EOS (2) best, then stop id 3
    sampler = Sampler(eos_token_ids=[EOS])
    r = request(temperature=0, min_tokens=2, max_tokens=5, stop_token_ids=[3])
    assert sampler(logits.clone(), [r])[0].token_id == 1
    r.token_ids.append(1)
    assert sampler(logits.clone(), [r])[0].token_id == 1
    r.token_ids.append(1)
    assert sampler(logits.clone(), [r])[0].token_id == EOS  # two out: EOS allowed again
    # A row with only banned tokens left (a grammar that may only end) keeps them.
    only_end = torch.tensor([[NEG, NEG, 1.0, NEG, NEG]])
    r = request(min_tokens=3, max_tokens=5, temperature=0.7)
    assert sampler(only_end.clone(), [r])[0].token_id == EOS


def test_min_tokens_is_validated():
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    for bad in (-1, 5, 1.5, True):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(min_tokens=bad, max_tokens=4)
        assert e.value.param == "min_tokens"


# -- draws ----------------------------------------------------------------------------------

PROBS8 = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
DRAWN = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.4, top_k=5),
    dict(top_p=0.7),
    dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.1),
    dict(min_p=0.2, temperature=1.2),
]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the support was drawn"
    expected = probs[support] * n
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize(
    ("kw", "seeded"),
    [(kw, True) for kw in DRAWN] + [(DRAWN[0], False), (DRAWN[4], False)],
    ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else
    ("seeded" if x else "unseeded"),
)
def test_draws_follow_the_distribution(kw, seeded):
    """20k draws: 1000 requests (seeds 0..999, or the engine's) x 20 positions, against the
    reference (chi-square at significance 1e-3; fixed seeds make the outcome deterministic)."""
    n, steps = 1000, 20
    sampler = Sampler(seed=11)
    reqs = [request(f"r{i}", seed=i if seeded else None, **kw) for i in range(n)]
    logits = PROBS8.log().repeat(n, 1)
    counts = torch.zeros(8, dtype=torch.float64)
    for _ in range(steps):
        tokens = [s.token_id for s in sampler(logits.clone(), reqs)]
        for r, t in zip(reqs, tokens, strict=True):
            r.token_ids.append(t)
        counts += torch.bincount(torch.tensor(tokens), minlength=8)
    stat, df = _chi2(counts, ref_probs(PROBS8.log(), reqs[0].params))
    assert stat < CHI2_CRIT[df], (stat, df)


def test_draws_across_blocks_follow_the_distribution():
    """The race runs in two rounds (a block of token ids, then a token of it): a support
    spread over blocks, and two tokens sharing one, still draws by the probabilities."""
    v, n, steps = 500, 1000, 20  # blocks of 32 ids; the last one short (20)
    support = torch.tensor([0, 1, 31, 32, 200, 201, 300, 499])
    logits = torch.full((v,), NEG)
    logits[support] = PROBS8.log()
    reqs = [request(f"r{i}", seed=i) for i in range(n)]
    sampler = Sampler()
    counts = torch.zeros(v, dtype=torch.float64)
    for _ in range(steps):
        tokens = [s.token_id for s in sampler(logits.repeat(n, 1), reqs)]
        for r, t in zip(reqs, tokens, strict=True):
            r.token_ids.append(t)
        counts += torch.bincount(torch.tensor(tokens), minlength=v)
    stat, df = _chi2(counts, torch.zeros(v).index_put_((support,), PROBS8).double())
    assert stat < CHI2_CRIT[df], (stat, df)


def test_seeded_request_gives_the_same_tokens_in_any_batch():
    """Alone, or at another row of a batch of 5 whose other rows change the batch's path
    (a top-p row forces a full sort; greedy, logprobs and penalty rows beside it)."""
    v, steps = 50, 12
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(steps, 6, v, generator=gen) * 2  # logits by step, for 6 "requests"
    kw = dict(temperature=0.9, seed=1234, max_tokens=steps)

    def run(params: list[dict], row: int) -> list[int]:
        sampler = Sampler(seed=99)
        reqs = [request(f"r{i}", [5, 6], **p) for i, p in enumerate(params)]
        out = []
        for step in range(steps):
            logits = table[step, : len(reqs)].clone()
            logits[row] = table[step, 5]  # the seeded request's logits
            for r, s in zip(reqs, sampler(logits, reqs), strict=True):
                r.token_ids.append(s.token_id)
            out.append(reqs[row].token_ids[-1])
        return out

    alone = run([kw], 0)
    others = [dict(temperature=0), dict(top_p=0.8), dict(temperature=1.1, logprobs=2),
              dict(presence_penalty=1.0, temperature=0.5)]
    assert run([*others[:2], kw, *others[2:]], 2) == alone
    assert run([kw, *others], 0) == alone
    assert run([*others, kw], 4) == alone
    top_k = dict(kw, top_k=7)  # the top-k path alone, the full sort with a top-p row beside
    assert run([top_k], 0) == run([dict(top_p=0.5), top_k, *others[:3]], 1)
    assert len(set(alone)) > 3  # it really sampled


def test_unseeded_requests_differ_and_follow_the_engine_seed():
    logits = torch.zeros(4, 1000)

    def draw(seed):
        reqs = [request(f"r{i}") for i in range(4)]
        return [s.token_id for s in Sampler(seed)(logits.clone(), reqs)]

    assert draw(0) == draw(0) != draw(1)
    assert len(set(draw(0))) == 4


def test_release_forgets_the_request():
    sampler = Sampler()
    r = request(presence_penalty=1.0)
    sampler(torch.zeros(1, 8), [r])
    assert "r" in sampler._states
    sampler.release("r")
    assert "r" not in sampler._states


def test_noise_is_exact_integer_arithmetic():
    """The uniforms equal the definition computed with Python ints: no float rounding, so
    every device gives the same bits."""
    key = mix(0xDEADBEEF, 7)
    ids = torch.arange(0, 200_000, 997)
    got = open_uniform(hash32(hash32(ids) ^ key)).tolist()
    for t, u in zip(ids.tolist(), got, strict=True):
        h = hash32(hash32(t) ^ key)
        assert u == ((h >> 8) | 1) / 2**24 and 0.0 < u < 1.0


def test_rows_not_ok_come_back_as_minus_one():
    """The runner's non-finite flags ride with the tokens: a row not ok gets token -1 and no
    logprob; the others are sampled as if it were not there."""
    sampler = Sampler(seed=0)
    rs = [Request(f"r{i}", [1], SamplingParams(temperature=t, logprobs=1, seed=7))
          for i, t in enumerate([0.0, 0.0, 1.0])]
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 0.0], [0.0, 0.0, 30.0]])
    out = sampler(logits.clone(), rs, ok=torch.tensor([True, False, True]))
    assert [s.token_id for s in out] == [1, -1, 2]
    assert out[1].logprob is None and out[0].logprob.token_id == 1
    assert out[0].logprob.top[0][0] == 1 and out[2].logprob.token_id == 2


def test_logprobs_are_before_temperature_and_filters():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    want = torch.log_softmax(logits[0], dim=-1)
    for kw in (dict(temperature=0), dict(temperature=0.3, top_k=1), dict(logprobs=0)):
        r = request(**{"logprobs": 2, **kw})
        lp = Sampler()(logits.clone(), [r])[0].logprob
        assert lp.logprob == pytest.approx(float(want[lp.token_id]))
        k = r.params.logprobs
        assert [t for t, _ in lp.top] == [2, 1][:k]
        assert [x for _, x in lp.top] == pytest.approx(want[[2, 1][:k]].tolist())


def test_every_path_in_one_batch_of_all_parameters():
    """Smoke over the product of the parameters: every row draws a token of its support."""
    sampler = Sampler(seed=5, eos_token_ids=[EOS])
    combos = list(itertools.product([0.0, 0.7], [-1, 3], [1.0, 0.8], [0.0, 0.1], [None, 9]))
    reqs = [request(f"r{i}", [2, 3], [4], temperature=t, top_k=k, top_p=p, min_p=m, seed=s,
                    logprobs=1, presence_penalty=0.5, min_tokens=2, max_tokens=4,
                    logit_bias={6: 1.0})
            for i, (t, k, p, m, s) in enumerate(combos)]
    logits = torch.randn(len(reqs), 12, generator=torch.Generator().manual_seed(4))
    dist = sampler.distribution(logits, reqs)
    for s, d in zip(sampler(logits.clone(), reqs), dist, strict=True):
        assert d[s.token_id] > 0 and s.token_id != EOS
        assert s.logprob.token_id == s.token_id

"""Suffix decoding (engine/spec/suffix.py): drafts from what earlier requests of the same
tenant and adapter wrote, beside the sequence's own text. The drafter's rules on token lists;
then on the real SmolLM2: outputs identical to plain decoding (greedy, seeded, logprobs, a stop
string and max_tokens inside drafts) while a repeated workload drafts more from its first
run; and no draft ever carries another tenant's text (a planted secret)."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.params import SamplingParams
from engine.spec.loop import SLACK, HintGate
from engine.spec.speculative import PromptLookup, Speculator
from engine.spec.suffix import ANCHOR, SuffixDrafter
from tests.test_speculative import _assert_same_outputs, _mixed_workload, looping


def test_drafts_follow_the_namespaces_earlier_outputs():
    d = SuffixDrafter(max_tokens=1000)
    d.learn("A", prompt=[1, 2, 3], output=[10, 11, 12, 13, 14, 15, 16, 17])
    context = [5, 6, 11, 12, 13]
    assert d.propose(context, 8, "A") == [14, 15, 16, 17]  # to the end of what it saw
    assert d.propose(context, 2, "A") == [14, 15]  # never past k
    assert d.propose(context, 8, "B") == []  # another namespace's text: nothing
    assert d.propose(context, 8) == []
    # A match's length bounds the draft (twice it): 3 tokens matched, 6 drafted at most.
    d.learn("A", prompt=[], output=[21, 22, 23] + list(range(30, 50)))
    assert d.propose([9, 21, 22, 23], 16, "A") == list(range(30, 36))
    # The prompt's last tokens come before an output: the answer's start is found.
    assert d.propose([7, 7, 1, 2, 3], 3, "A") == [10, 11, 12]


def test_the_candidates_vote_and_a_split_stops_the_draft():
    d = SuffixDrafter(max_tokens=1000)
    for tail in ([5, 6, 7], [5, 6, 7], [5, 8, 9]):  # two of three go on 6, 7 after 5
        d.learn("A", prompt=[], output=[1, 2, 3, 4, *tail])
    assert d.propose([0, 1, 2, 3, 4], 8, "A") == [5, 6, 7]
    for tail in ([40], [41], [42], [43]):  # four continuations, one each: 1/4 < MIN_PROB
        d.learn("B", prompt=[], output=[1, 2, 3, 4, *tail])
    assert d.propose([0, 1, 2, 3, 4], 8, "B") == []
    # A longer match outvotes shorter ones: only the candidates matching longest vote.
    d.learn("C", prompt=[], output=[9, 9, 1, 2, 3, 50, 51])
    d.learn("C", prompt=[], output=[7, 8, 1, 2, 3, 60, 61])
    d.learn("C", prompt=[], output=[6, 8, 1, 2, 3, 60, 61])
    assert d.propose([9, 9, 1, 2, 3], 2, "C") == [50, 51]


def test_the_sequence_itself_drafts_as_prompt_lookup_does():
    d, lookup = SuffixDrafter(), PromptLookup()
    for tokens in ([1, 2, 3, 4, 5, 6, 9, 9, 2, 3, 4], [1, 2, 3, 4, 1, 2], [4, 2, 5, 2]):
        assert d.propose(tokens, 3) == lookup.propose(tokens, 3)


def test_the_corpus_keeps_to_its_size_least_recently_used_first():
    d = SuffixDrafter(max_tokens=40)
    for i in range(6):  # 6 outputs of 10 tokens each, prompts empty
        d.learn(("t", i % 2), prompt=[], output=[100 * i + j for j in range(10)])
    assert d.num_tokens == 40
    assert d.propose([0, 1, 2], 4, ("t", 0)) == []  # the first output is gone ...
    assert d.propose([400, 401, 402], 4, ("t", 0)) == [403, 404, 405, 406]  # ... the last kept
    # The index holds the entries kept, and those removed at most as many hits again (they
    # are dropped when the index is rebuilt).
    for corpus in d._corpora.values():
        hits = [key for grams in corpus.index.values() for key, _ in grams]
        live = sum(len(t) - ANCHOR + 1 for t in corpus.entries.values())
        assert set(corpus.entries) <= set(hits)
        assert sum(key in corpus.entries for key in hits) == corpus.live == live
        assert len(hits) - live == corpus.stale <= live
    # Drafting from an entry makes it recently used: the next output evicts the other one.
    d.propose([200, 201, 202], 4, ("t", 0))
    d.learn(("t", 1), prompt=[], output=list(range(900, 910)))
    assert d.propose([200, 201, 202], 4, ("t", 0)) == [203, 204, 205, 206]
    assert d.propose([300, 301, 302], 4, ("t", 1)) == []
    churn = SuffixDrafter(max_tokens=50)  # many outputs through a small corpus
    for i in range(100):
        churn.learn("A", prompt=[], output=[1000 * i + j for j in range(10)])
        corpus = churn._corpora["A"]
        hits = sum(len(grams) for grams in corpus.index.values())
        assert corpus.live == 8 * min(i + 1, 5)  # 5 outputs of 10 tokens kept, 8 hits each
        assert hits == corpus.live + corpus.stale <= 2 * corpus.live
    assert churn.propose([99000, 99001, 99002], 3, "A") == [99003, 99004, 99005]
    assert churn.propose([94000, 94001, 94002], 3, "A") == []
    off = SuffixDrafter(max_tokens=0)  # no corpus: the sequence's own text only
    off.learn("A", prompt=[], output=[7, 8, 9, 10])
    assert off.num_tokens == 0 and off.propose([7, 8, 9], 2, "A") == []
    assert off.propose([1, 2, 1, 2], 2, "A") == [1, 2]


def test_outputs_are_those_of_plain_decoding_and_a_second_run_drafts_more(smollm2):
    prompts, params, plain = _mixed_workload(smollm2)
    eng = smollm2.engine
    eng.reset_prefix_cache()
    free = eng.allocator.num_free
    eng.speculator = spec = Speculator(4, SuffixDrafter())
    try:
        first = smollm2.generate(prompts, params)
        drafted = spec.stats.drafted, spec.stats.accepted
        second = smollm2.generate(prompts, params)
    finally:
        eng.speculator = None
    _assert_same_outputs(first, plain)
    _assert_same_outputs(second, plain)
    again = spec.stats.drafted - drafted[0], spec.stats.accepted - drafted[1]
    assert again[1] > drafted[1]  # the second run drew on the first's outputs
    eng.reset_prefix_cache()
    assert eng.allocator.num_free == free


def test_the_loops_drafts_follow_the_hosts_hint():
    """The overlapped loop's device half (`propose_on_device` with hints): a row whose last
    tokens are in its hint drafts what follows them there, fillers from prompt lookup past
    the hint's end; a row that left its hint, or has none, drafts as prompt lookup does."""
    d = SuffixDrafter()
    rows = [[5, 6, 10, 11, 12, 13],  # the host saw up to 11; the device took 12, 13
            [5, 6, 10, 11, 12, 13],  # the same, but the hint's draft ends at 14
            [5, 6, 10, 11, 99, 98],  # the device left the hint
            [7, 8, 7, 8, 7, 8]]  # no hint
    hints = [[5, 6, 10, 11, 12, 13, 14, 15, 16, 17, 18], [5, 6, 10, 11, 12, 13, 14],
             [5, 6, 10, 11, 12, 13, 14, 15], []]
    tokens = torch.tensor([r + [0, 0] for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    own, own_looked = d.lookup.propose_on_device(tokens, lengths, 4)
    drafts, looked = d.propose_on_device(tokens, lengths, 4, hints)
    assert drafts[0].tolist() == [14, 15, 16, 17] and looked[0] == 4
    assert drafts[1, 0] == 14 and drafts[1, 1:].tolist() == own[1, 1:].tolist()
    assert looked[1] == 1
    assert drafts[2:].tolist() == own[2:].tolist() and looked[2:].tolist() == \
        own_looked[2:].tolist()


def test_hints_are_drafted_while_the_host_waits_on_the_device():
    """`HintGate`: on while the host still waits for each step after drafting hints; off
    within a few steps once it does not (the host is the bottleneck), and on again only when
    the wait exceeds what the hints cost."""
    gate = HintGate()
    for _ in range(20):  # a large model: the host waits 3 ms a step, hints take 0.4 ms
        gate.update(3e-3, 4e-4)
    assert gate.on
    gate, steps = HintGate(), 0
    while gate.on:  # a small model: the host never waits
        gate.update(0.0, 4e-4)
        steps += 1
    assert steps <= 2
    for _ in range(50):  # without hints it waits a little, less than they would cost
        gate.update(4e-4 + SLACK / 2, None)
    assert not gate.on
    for _ in range(50):
        gate.update(4e-4 + 2 * SLACK, None)
    assert gate.on


def test_the_overlapped_loop_drafts_from_the_corpus(smollm2):
    """In the overlapped loop (CUDA's default; run here on the CPU) suffix decoding drafts from
    earlier outputs through the host's hints: outputs are those of plain decoding, and a
    second run of the same requests emits more tokens per verify step than its first."""
    prompts, params, plain = _mixed_workload(smollm2)
    eng = smollm2.engine
    eng.reset_prefix_cache()
    with looping(smollm2) as (spec, steps):
        spec.drafter = SuffixDrafter()
        first = smollm2.generate(prompts, params)
        once = spec.stats.emitted / spec.stats.forwards
        emitted, forwards = spec.stats.emitted, spec.stats.forwards
        eng.reset_prefix_cache()
        second = smollm2.generate(prompts, params)
        twice = (spec.stats.emitted - emitted) / (spec.stats.forwards - forwards)
    _assert_same_outputs(first, plain)
    _assert_same_outputs(second, plain)
    assert steps and twice > once + 0.5, (once, twice)
    eng.reset_prefix_cache()


SECRET = "The vault code is QX-7731-ZEBRA-PLUM."


def _run(engine, prompt, tenant):
    rid = f"suffix-{tenant}-{len(engine._requests)}-{id(prompt)}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=24, temperature=0), tenant)
    out = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.new_token_ids
    return out


def test_no_draft_comes_from_another_tenants_text(smollm2):
    """Tenant A's outputs quote a secret; tenant B then asks what follows the same words.
    A's repeat request drafts the secret from A's earlier output; none of B's drafts holds
    any three tokens of it, though B's context matches A's output as well."""
    tok, eng = smollm2.tokenizer, smollm2.engine

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                                  tokenize=False, add_generation_prompt=True))

    secret = tok.encode(" " + SECRET.split(" is ")[1], add_special_tokens=False)
    grams = {tuple(secret[i : i + 3]) for i in range(len(secret) - 2)}
    drafter = SuffixDrafter()
    proposed: dict[str, list[list[int]]] = {"A": [], "B": []}
    propose = drafter.propose

    def recording(tokens, k, namespace=None):
        out = propose(tokens, k, namespace)
        proposed[namespace[0]].append(out)
        return out

    drafter.propose = recording  # type: ignore[method-assign]
    eng.reset_prefix_cache()
    eng.speculator = Speculator(4, drafter)
    try:
        wrote = _run(eng, chat(f"Repeat this sentence exactly: {SECRET}"), "A")
        assert any(g in {tuple(wrote[i : i + 3]) for i in range(len(wrote))} for g in grams), \
            tok.decode(wrote)  # A's output does quote the secret
        _run(eng, chat(f"Say this sentence exactly once: {SECRET}"), "A")
        _run(eng, chat("Say this sentence exactly once: The vault code is"), "B")
    finally:
        eng.speculator = None
        eng.reset_prefix_cache()

    def leaks(drafts: list[list[int]]) -> bool:
        return any(tuple(d[i : i + 3]) in grams for d in drafts for i in range(len(d) - 2))

    assert leaks(proposed["A"])  # the control: A drafts its own earlier text
    assert not leaks(proposed["B"])
    context = tok.encode("The vault code is", add_special_tokens=False)
    assert leaks([drafter.propose(context, 8, ("A", None, 0))])
    assert not leaks([drafter.propose(context, 8, ("B", None, 0))])


@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_the_engine_config_picks_the_drafter(method, smollm2_dir):
    from engine import LLM

    llm = LLM(model=str(smollm2_dir), num_speculative_tokens=2, speculative_method=method,
              suffix_cache_tokens=1000, num_pages=64)
    drafter = llm.engine.speculator.drafter
    assert isinstance(drafter, SuffixDrafter if method == "suffix" else PromptLookup)
    if method == "suffix":
        assert drafter.max_tokens == 1000

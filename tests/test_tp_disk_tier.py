"""The disk KV tier with two tensor-parallel ranks on CPUs: each rank keeps its KV heads'
share of a session's pages as files of its own, a restarted pair resumes the session from
them with the tokens of a cold run, and a page file bad on one rank only stops the read
there on every rank (then gets written again)."""

from __future__ import annotations

from pathlib import Path

from engine import LLM
from tests.test_prefix_cache_model import run

NAMESPACE = ("default", None, 0)  # the default tenant's base model (`Request.namespace`)


def _files(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.kvpage")}


def test_two_ranks_resume_a_session_from_their_page_files(smollm2_dir, smollm2, tmp_path):
    tok = smollm2.tokenizer
    prompt = tok.encode("Tool result: " + ", ".join(
        f"row {i} has value {i * 7 % 13}" for i in range(40)))
    kw = dict(model=str(smollm2_dir), tensor_parallel_size=2, num_pages=64, host_kv_pages=64,
              max_loras=0, kv_disk_dir=tmp_path)
    with LLM(**kw) as llm:
        reply, _ = run(llm.engine, prompt, session="S")
        turn = prompt + reply + tok.encode(" And the next row?")
        cold, _ = run(llm.engine, turn, tenant="cold")  # another tenant: nothing cached
        disk = llm.engine.prefix_cache.tiers.disk
        mine = disk.dir
        keys = disk.keys(NAMESPACE, turn, 16, len(prompt) // 16)
    # Closing waited for every rank's writes: a folder per rank, the same pages in each.
    theirs, = (d for d in tmp_path.iterdir() if d != mine)
    assert set(keys) <= _files(mine) and _files(theirs) == _files(mine)

    with LLM(**kw) as llm:
        tokens, cached = run(llm.engine, turn, session="S2")
        assert tokens == cold
        assert cached >= len(prompt) - 16
        stats = llm.engine.prefix_cache.stats()
        assert stats.disk_hit_tokens >= len(prompt) - 16 and stats.disk_pages_rejected == 0

    bad = theirs / f"{keys[5]}.kvpage"  # rank 1's share of page 5 only
    data = bytearray(bad.read_bytes())
    data[-7] ^= 0xFF
    bad.write_bytes(bytes(data))
    with LLM(**kw) as llm:
        tokens, cached = run(llm.engine, turn, session="S3")
        assert tokens == cold
        assert 5 * 16 <= cached < 6 * 16  # the pages before the bad one, on both ranks
        disk = llm.engine.prefix_cache.tiers.disk
        disk.flush()
        assert disk.rejected_pages == 0  # rank 0's own file was good ...
        assert disk.pages_written == 1  # ... dropped, and written again by the turn's end
    assert bad.read_bytes() != data and len(bad.read_bytes()) == len(data)
    assert _files(theirs) == _files(mine)

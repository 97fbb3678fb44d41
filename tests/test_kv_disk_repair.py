"""The disk KV tier repairs itself: a page file that does not check out is deleted and dropped
from the index when a resume refuses it, so the turn's write-through writes it again and the
next restart reads it; temporary files a crash left are deleted when the tier starts."""

from __future__ import annotations

import os

import torch

from engine import LLM
from engine.kv.disk import DiskKV
from tests.test_kv_tiers import DEVICE_PAGES, _session_turns, check_owners, prompts  # noqa: F401
from tests.test_prefix_cache_model import run

BASE = ("default", None, 0)  # the base model's namespace for the default tenant


def test_a_refused_page_is_dropped_then_written_again(smollm2_dir, prompts,  # noqa: F811
                                                      tmp_path):
    """Engine A writes a session through; a page file is truncated (a crash, a full disk);
    engine B's resume refuses it and drops it, and the turn's write-through writes it again;
    engine C, started over a stale temporary file, deletes that and reads every page."""
    kw = dict(model=str(smollm2_dir), max_num_seqs=4, num_pages=DEVICE_PAGES, host_kv_pages=64,
              kv_disk_dir=tmp_path)
    a = LLM(**kw).engine
    turn = _session_turns(a, prompts)
    a.prefix_cache.tiers.disk.flush()
    cold = run(a, turn, tenant="cold")  # another tenant: nothing cached
    keys = a.prefix_cache.tiers.disk.keys(BASE, turn, 16, len(prompts[0]) // 16)
    folder = a.prefix_cache.tiers.disk.dir
    del a
    bad = folder / f"{keys[5]}.kvpage"
    bad.write_bytes(bad.read_bytes()[:1000])

    b = LLM(**kw).engine
    disk = b.prefix_cache.tiers.disk
    assert keys[5] in disk.index  # started with the file: it is checked when read
    tokens, cached = run(b, turn, session="S2")
    assert tokens == cold[0] and 5 * 16 <= cached < 6 * 16  # the pages before it only
    assert b.prefix_cache.stats().disk_pages_rejected == 1
    disk.flush()  # the turn's write-through, queued when it ended
    assert keys[5] in disk.index  # written again, whole:
    assert bad.stat().st_size == (folder / f"{keys[4]}.kvpage").stat().st_size
    assert disk.nbytes == sum(f.stat().st_size for f in disk.dir.glob("*.kvpage"))
    written = b.prefix_cache.stats().disk_pages_written
    assert written >= 1
    b.release_session("S2")
    check_owners(b)
    del b

    stale = folder / f".{keys[6]}.tmp"  # a write the crash cut short
    stale.write_bytes(b"switchboard-kv-page 1\n{half a")
    c = LLM(**kw).engine
    assert not stale.exists() and not list(folder.glob("*.tmp"))
    tokens, cached = run(c, turn, session="S3")
    assert tokens == cold[0] and cached >= len(prompts[0]) - 16
    stats = c.prefix_cache.stats()
    assert stats.disk_pages_rejected == 0 and stats.disk_hit_tokens >= len(prompts[0]) - 16
    c.release_session("S3")


def test_a_page_refused_by_a_read_is_forgotten(tmp_path):
    """The tier alone, a payload byte flipped: the rejected key leaves the index and the byte
    count, its file is gone, and `missing` offers it for writing again."""
    shape = (2, 2, 4, 1, 8)
    disk = DiskKV(tmp_path, "b" * 64, shape, torch.float32)
    keys = disk.keys("ns", list(range(12)), 4, 3)
    disk.write(keys, torch.randn(3, *shape), lambda: None)
    disk.flush()
    size = disk.nbytes // 3
    path = disk.dir / f"{keys[1]}.kvpage"
    data = path.read_bytes()
    path.write_bytes(data[:-7] + bytes([data[-7] ^ 0xFF]) + data[-6:])
    got = []
    assert disk.read(keys, lambda i, page: got.append(i), before=lambda: None).result() == 1
    assert got == [0] and disk.rejected_pages == 1
    assert disk.index == {keys[0], keys[2]} and disk.nbytes == 2 * size
    assert not path.exists() and disk.missing(keys) == [1]
    disk.write([keys[1]], torch.randn(1, *shape), lambda: None)
    disk.flush()
    assert disk.read(keys, lambda i, page: None, before=lambda: None).result() == 3
    assert disk.nbytes == 3 * size


def test_stale_temporary_files_are_deleted_at_start(tmp_path):
    """A write cut short by a crash leaves `.{key}.tmp`: a fresh tier deletes it, keeps the
    page files and counts only them."""
    shape = (2, 2, 4, 1, 8)
    disk = DiskKV(tmp_path, "c" * 64, shape, torch.float32)
    keys = disk.keys("ns", list(range(8)), 4, 2)
    disk.write(keys[:1], torch.randn(1, *shape), lambda: None)
    disk.flush()
    stale = disk.dir / f".{keys[1]}.tmp"
    stale.write_bytes(b"switchboard-kv-page 1\n{half a page")
    os.utime(stale, (1, 1))
    del disk

    fresh = DiskKV(tmp_path, "c" * 64, shape, torch.float32)
    assert not stale.exists()
    assert sorted(p.name for p in fresh.dir.iterdir()) == [f"{keys[0]}.kvpage"]
    assert fresh.index == {keys[0]} and fresh.missing(keys) == [1]
    assert fresh.nbytes == (fresh.dir / f"{keys[0]}.kvpage").stat().st_size

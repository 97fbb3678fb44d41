"""Rank 0's shared-memory message channel to the tensor-parallel workers
(`engine.parallel.channel.ShmChannel`), with real reader processes."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from multiprocessing import shared_memory

import pytest

from engine.parallel.channel import ChannelClosed, ShmChannel

SLOTS, SLOT_BYTES = 3, 256  # small: messages span slots and the writer waits for room


def _messages(n: int) -> list[object]:
    rng = random.Random(7)
    out: list[object] = []
    for i in range(n):
        size = rng.choice([0, 1, 10, 200, 255, 256, 257, 900, 5000])
        out.append({"i": i, "blob": rng.randbytes(size), "ids": list(range(size % 37))})
    out.append("stop")
    return out


def _reader(name: str, readers: int, reader: int, slow: bool, results: mp.Queue) -> None:
    ch = ShmChannel.attach(name, readers, reader, SLOTS, SLOT_BYTES)
    got = []
    while (msg := ch.recv()) != "stop":
        got.append(msg)
        if slow and len(got) % 17 == 0:
            time.sleep(0.02)  # the writer fills the ring meanwhile and must wait
    ch.close()
    results.put((reader, got))


def test_every_reader_gets_every_message_in_order() -> None:
    ctx = mp.get_context("spawn")
    ch = ShmChannel.create(2, SLOTS, SLOT_BYTES)
    results = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(ch.name, 2, r, r == 1, results))
             for r in range(2)]
    for p in procs:
        p.start()
    sent = _messages(300)
    for m in sent:
        ch.send(m)
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert got[0] == sent[:-1] and got[1] == sent[:-1]
    name = ch.name
    ch.close()
    ch.close()  # idempotent
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)  # the writer removed the segment


def test_a_writer_waiting_on_a_reader_that_stopped_gives_up() -> None:
    ch = ShmChannel.create(1, SLOTS, SLOT_BYTES)
    try:
        for i in range(SLOTS):  # the ring is full: nobody reads
            ch.send(i)
        t = time.monotonic()
        with pytest.raises(ChannelClosed):
            ch.send("one more", alive=lambda: time.monotonic() - t < 0.2)
        assert time.monotonic() - t < 5
        with pytest.raises(ChannelClosed):
            ch.send("one more", timeout=0.1)
    finally:
        ch.close()


def test_a_reader_reads_what_was_sent_before_it_looked() -> None:
    ch = ShmChannel.create(1, SLOTS, SLOT_BYTES)
    reader = ShmChannel.attach(ch.name, 1, 0, SLOTS, SLOT_BYTES)
    try:
        big = bytes(range(256)) * 3  # three slots' worth: the whole ring
        ch.send(big[:600])
        assert reader.recv() == big[:600]
        ch.send("a")
        ch.send("b")
        assert (reader.recv(), reader.recv()) == ("a", "b")
    finally:
        reader.close()
        ch.close()

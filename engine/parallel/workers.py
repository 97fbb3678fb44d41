"""Tensor parallelism's worker processes (ranks 1..): started, watched and stopped by rank 0
(`Workers`), each running `_worker_main`: load its shard, build the same model runner as rank
0, then run rank 0's messages (`engine.parallel.collectives`) until told to stop.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig, ModelConfig, ModelLoadError, ResolvedConfig
from engine.ipc.parent_watch import watch_parent
from engine.kv.disk import disk_tier
from engine.parallel.collectives import (
    COLLECTIVE_TIMEOUT,
    STOP,
    Forward,
    KVLoad,
    KVOffload,
    LoadSlot,
    RankDied,
    Setup,
    TPGroup,
    rank_fingerprint,
    run_host_kv,
)
from engine.parallel.disk import KVRead, KVWrite, WorkerDisk
from engine.parallel.partition import Partition
from engine.runner.loader import load_model
from engine.runner.model_runner import build_runner
from lora.slots import LoraSlots

log = logging.getLogger(__name__)


# -- rank 0's side ----------------------------------------------------------------------------


class Workers:
    """Rank 0's handle on the worker processes: started with the engine, watched while it
    runs, stopped with it."""

    def __init__(self, cfg: EngineConfig, model_dir: Path) -> None:
        size = cfg.tensor_parallel_size
        device = torch.device(cfg.device)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ModelLoadError(f"tensor_parallel_size={size} needs {size} GPUs; "
                                 f"{torch.cuda.device_count()} are visible")
        port = _free_port()
        ctx = mp.get_context("spawn")
        joining = [ctx.Event() for _ in range(1, size)]
        # Each worker's answers to rank 0 (the disk tier's reads: engine/parallel/disk.py).
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, size)]
        self.answers = [recv for recv, _ in pipes]
        self.procs = [
            ctx.Process(target=_worker_main, args=(rank, size, port, cfg, model_dir,
                                                   joining[rank - 1], pipes[rank - 1][1]),
                        name=f"switchboard-tp{rank}", daemon=True)
            for rank in range(1, size)
        ]
        self._closing = False
        self._reaping = threading.Lock()
        for p in self.procs:
            p.start()
        for _, send in pipes:
            send.close()  # the workers' now: a pipe reads EOF once its worker exits
        self._await_joining(joining)
        self.tp = TPGroup.join(0, size, port, device)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def _await_joining(self, joining: list[Any]) -> None:
        """Wait until every worker is about to join the group (its `joining` event set). One
        that exits first (its imports or its device failed) fails the start now, not after
        the group's rendezvous timeout."""
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while not all(e.is_set() for e in joining):
            wait([p.sentinel for p in self.procs], timeout=0.05)
            why = self.dead() or ("a tensor-parallel worker did not start in time"
                                  if time.monotonic() > deadline else None)
            if why is not None:
                for p in self.procs:
                    p.kill()
                    p.join()
                raise ModelLoadError(f"{why} before joining the group")

    def agree(self, cfg: ResolvedConfig, eos_token_ids: list[int], mine: dict[str, Any]) -> None:
        """Send the settled config; check every worker loaded the same model (`mine`: rank 0's
        `fingerprint`). Raises ModelLoadError naming the first rank that differs or failed."""
        self.tp.send(Setup(cfg, eos_token_ids))
        for rank, theirs in enumerate(self.tp.gather_objects(mine)):
            if isinstance(theirs, str):
                raise ModelLoadError(f"tensor-parallel rank {rank} failed to load: {theirs}")
            if theirs != mine:
                diff = sorted(k for k in mine if theirs.get(k) != mine[k])
                raise ModelLoadError(f"tensor-parallel rank {rank} disagrees with rank 0 on "
                                     f"{', '.join(diff)}")

    def dead(self) -> str | None:
        """Why the group cannot run (a worker exited), else None. A worker whose sentinel is
        ready is reaped first: the kernel closes a dying process's pipes and sockets before
        it makes the exit reapable, so `exitcode` alone can still read None then."""
        with self._reaping:
            for p in self.procs:
                if p.exitcode is None and wait([p.sentinel], timeout=0):
                    p.join(1.0)
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                return (f"tensor-parallel rank {rank} (pid {p.pid}) exited with code "
                        f"{p.exitcode}")
        return None

    def check(self) -> None:
        why = self.dead()
        if why is not None:
            raise RankDied(f"{why}; the engine cannot run")

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around a step: RankDied before it once a worker exited, and instead of the error a
        collective raises when a worker exits during it (the peer's socket closes first, so
        the exit is waited for briefly)."""
        self.check()
        try:
            yield
        except Exception as e:
            wait([p.sentinel for p in self.procs], timeout=1.0)
            why = self.dead()
            if why is None:
                raise
            raise RankDied(f"{why}; the engine cannot run") from e
        self.check()  # a step whose collectives were aborted (`_watch`) returned garbage

    def close(self) -> None:
        """Stop the workers (they free their graphs and leave their loops) and leave the
        group with them: NCCL's teardown meets the peers', so rank 0 leaves before it waits
        for the workers to exit."""
        if self._closing:
            return
        self._closing = True
        if self.dead() is None:
            try:
                self.tp.send(STOP)
            except Exception:  # noqa: BLE001 - a worker died meanwhile; kill the rest below
                log.warning("could not tell the tensor-parallel workers to stop")
        self.tp.close()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                log.warning("tensor-parallel worker %s did not exit; killed", p.name)
                p.kill()
                p.join()

    def _watch(self) -> None:
        """A worker that exits while the engine runs: on GPUs, its peers' collectives would
        wait for it forever, so the group is aborted (`TPGroup.abort`) and the step fails."""
        wait([p.sentinel for p in self.procs])
        if not self._closing:
            log.error("%s; the engine stops serving (not ready)", self.dead())
            self.tp.abort()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a worker ---------------------------------------------------------------------------------


def _worker_main(rank: int, size: int, port: int, cfg: EngineConfig, model_dir: Path,
                 joining: Any, answers: Connection) -> None:
    """Rank `rank`: load this rank's shard, build the same model runner as rank 0, then run
    rank 0's messages until it says stop (or goes away). `joining` is set just before it
    joins the group; `answers` carries what rank 0 asks back (`WorkerDisk`)."""
    watch_parent(os.getppid())  # a rank exits with its core, even one killed with -9
    device = torch.device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // size))
    joining.set()
    tp = TPGroup.join(rank, size, port, device)
    try:
        dtype = getattr(torch, cfg.dtype)
        try:  # while rank 0 loads its own shard
            mc = ModelConfig.from_dir(model_dir)
            part = Partition.of(mc, rank, size)
            model = load_model(model_dir, dtype, device, part, tp,
                               cfg.load_quantization)
            mine: Any = rank_fingerprint(mc, model_dir, model)
        except Exception as e:  # reported by rank 0, which then stops every rank
            mine = f"{type(e).__name__}: {e}"
        setup = tp.recv()
        if setup == STOP:  # rank 0 failed to load
            return
        tp.gather_objects(mine)
        if isinstance(mine, str):
            return
        c = setup.cfg
        slots = (LoraSlots(part.local(mc), c.max_loras, c.lora_pool_rows, c.max_lora_rank,
                           dtype, device, part.cut_lora) if c.max_loras else None)
        runner = build_runner(model, c, setup.eos_token_ids, slots, tp)
        disk = None
        if runner.host_kv is not None:
            tier = disk_tier(c, mc, model_dir, runner.host_kv.pool.shape, rank, size)
            disk = WorkerDisk(tier, runner.host_kv, answers) if tier is not None else None
        try:
            while (msg := tp.recv()) != STOP:
                if isinstance(msg, Forward):
                    ids = None
                    if msg.fed:
                        ids = tp.broadcast(torch.empty(msg.fed, dtype=torch.long,
                                                       device=device))
                    runner.forward(msg.inputs, ids)
                elif isinstance(msg, LoadSlot):
                    assert slots is not None, "rank 0 loads adapters only with LoRA on"
                    slots.write(msg.slot, msg.adapter, msg.starts)
                elif isinstance(msg, KVOffload | KVLoad):
                    assert runner.host_kv is not None, "rank 0 copies KV only with a host tier"
                    run_host_kv(runner.host_kv, msg)
                elif isinstance(msg, KVWrite | KVRead):
                    assert disk is not None, "rank 0 sends KV file work only with a disk tier"
                    disk.run(msg)
        finally:
            runner.close()  # the graphs go before the communicator they captured
            if disk is not None:
                disk.close()
    finally:
        tp.close()



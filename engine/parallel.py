"""Tensor parallelism's processes and collectives (`EngineConfig.tensor_parallel_size`).

Rank 0 is the engine: the scheduler, prefix cache, sessions, grammar masks and sampling run
there once per step. Ranks 1.. are worker processes (`_worker_main`) holding their shard of the
model (`engine.partition`) and of the paged KV pool (their KV heads, the same page ids). For
each step rank 0 broadcasts the step's host inputs (`StepInputs`) and every rank runs the same
forward: the ranks meet in one all-reduce after each row-parallel projection and an all-gather
of the vocabulary shards' logits; only rank 0 samples. Adapters loaded into a slot on rank 0
are sent to the workers in the same order, before any step that uses them.

Collectives go through `torch.distributed` (NCCL between GPUs, gloo on CPUs); messages through
a gloo group. A worker that dies is noticed at once (its process sentinel): the engine logs it
and refuses every later step (`RankDied`), so a server goes not-ready instead of hanging.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import socket
import threading
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig, ModelLoadError, ResolvedConfig
from engine.partition import Partition
from lora.adapter import LoraAdapter
from lora.slots import LoraSlots

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank stuck this long fails the step
IDLE_TIMEOUT = timedelta(days=365)  # workers wait for rank 0's next message this long


class RankDied(RuntimeError):
    """A tensor-parallel worker exited: the engine cannot run another step."""


class TPGroup:
    """This process's rank in the tensor-parallel group, and the collectives the model uses."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        # Tensors go through the default group (NCCL on GPUs); messages (pickled objects) over
        # gloo, in a group of their own: an idle server's workers wait in it indefinitely.
        self.cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    @classmethod
    def join(cls, rank: int, size: int, port: int, device: torch.device) -> TPGroup:
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, size, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on each rank -> [N, size * C], rank r's columns r*C..(r+1)*C."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    def send(self, message: Any) -> None:
        """Rank 0: broadcast a message (any picklable object) to the workers."""
        dist.broadcast_object_list([message], src=0, group=self.cpu_group)

    def recv(self) -> Any:
        """A worker: the next message rank 0 sends."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place; no host sync on GPUs)."""
        dist.broadcast(x, src=0)
        return x

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- messages from rank 0 ---------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """After loading: the engine's settled config; the workers build their runners from it."""

    cfg: ResolvedConfig
    eos_token_ids: list[int]


@dataclass(frozen=True)
class Forward:
    """Run one step's forward (`ModelRunner.forward`). `fed`: how many input ids rank 0
    broadcasts on the device right after (the overlapped schedule's), 0 for none."""

    inputs: Any  # engine.step_inputs.StepInputs
    fed: int


@dataclass(frozen=True)
class LoadSlot:
    slot: int
    adapter: LoraAdapter  # host tensors, whole: each worker cuts its shard


STOP = "stop"


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
        self.procs = [
            ctx.Process(target=_worker_main, args=(rank, size, port, cfg, model_dir),
                        name=f"switchboard-tp{rank}", daemon=True)
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()
        self._closing = False
        self.tp = TPGroup.join(0, size, port, device)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

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
        """Why the group cannot run (a worker exited), else None."""
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                return (f"tensor-parallel rank {rank} (pid {p.pid}) exited with code "
                        f"{p.exitcode}")
        return None

    def check(self) -> None:
        why = self.dead()
        if why is not None:
            raise RankDied(f"{why}; the engine cannot run")

    def close(self) -> None:
        """Stop the workers (they leave their loops) and leave the group."""
        if self._closing:
            return
        self._closing = True
        if self.dead() is None:
            try:
                self.tp.send(STOP)
            except Exception:  # noqa: BLE001 - a worker died meanwhile; kill the rest below
                log.warning("could not tell the tensor-parallel workers to stop")
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        self.tp.close()

    def _watch(self) -> None:
        wait([p.sentinel for p in self.procs])
        if not self._closing:
            log.error("%s; the engine stops serving (not ready)", self.dead())


def fingerprint(cfg: ModelConfig, model_dir: Path, model: torch.nn.Module) -> dict[str, Any]:
    """What the ranks must agree on: the model's shape and files, the torch build, and the
    final norm's weights (replicated on every rank: a differing checkpoint shows there)."""
    config = model_dir / "config.json"
    return {
        "model": asdict(cfg),
        "config.json": hashlib.sha256(config.read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "dtype": str(model.norm.weight.dtype),
        "norm": hashlib.sha256(model.norm.weight.detach().float().cpu().numpy().tobytes())
        .hexdigest(),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a worker ---------------------------------------------------------------------------------


def _worker_main(rank: int, size: int, port: int, cfg: EngineConfig, model_dir: Path) -> None:
    """Rank `rank`: load this rank's shard, build the same model runner as rank 0, then run
    rank 0's messages until it says stop (or goes away)."""
    from engine.loader import load_model
    from engine.model_runner import ModelRunner
    from lora.layers import wrap_model

    device = torch.device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // size))
    tp = TPGroup.join(rank, size, port, device)
    try:
        dtype = getattr(torch, cfg.dtype)
        try:  # while rank 0 loads its own shard
            mc = ModelConfig.from_dir(model_dir)
            part = Partition.of(mc, rank, size)
            model = load_model(model_dir, dtype, device, part, tp)
            mine: Any = fingerprint(mc, model_dir, model)
        except Exception as e:  # reported by rank 0, which then stops every rank
            mine = f"{type(e).__name__}: {e}"
        setup = tp.recv()
        if setup == STOP:  # rank 0 failed to load
            return
        tp.gather_objects(mine)
        if isinstance(mine, str):
            return
        c = setup.cfg
        slots = (LoraSlots(part.local(mc), c.max_loras, c.max_lora_rank, dtype, device,
                           part.cut_lora) if c.max_loras else None)
        runner = ModelRunner(
            model, c.num_pages, c.page_size, c.seed, lora=wrap_model(model, slots) if slots
            else None, cuda_graph_max_batch=c.max_num_seqs if c.cuda_graphs else 0,
            max_model_len=c.max_model_len, eos_token_ids=setup.eos_token_ids, tp=tp,
        )
        while (msg := tp.recv()) != STOP:
            if isinstance(msg, Forward):
                ids = None
                if msg.fed:
                    ids = tp.broadcast(torch.empty(msg.fed, dtype=torch.long, device=device))
                runner.forward(msg.inputs, ids)
            elif isinstance(msg, LoadSlot):
                assert slots is not None, "rank 0 loads adapters only with LoRA on"
                slots.load(msg.slot, msg.adapter)
    finally:
        tp.close()


class SentSlots(LoraSlots):
    """Rank 0's adapter slots: an adapter loaded into a slot is sent to the workers' slots
    too, in order with the steps (a later step may use it)."""

    def __init__(self, *args: Any, tp: TPGroup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        super().load(slot, adapter)
        self.tp.send(LoadSlot(slot, adapter))

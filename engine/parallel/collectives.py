"""Tensor parallelism's collectives and messages (`EngineConfig.tensor_parallel_size`).

Rank 0 is the engine: the scheduler, prefix cache, sessions, grammar masks and sampling run
there once per step. Ranks 1.. are worker processes (`engine.parallel.workers`) holding their
shard of the model (`engine.parallel.partition`) and of the paged KV pool (their KV heads, the
same page ids). For each step rank 0 broadcasts the step's host inputs (`StepInputs`) and every
rank runs the same forward: the ranks meet in one all-reduce after each row-parallel
projection and an all-gather of the vocabulary shards' logits; only rank 0 samples. Adapters
loaded into a slot on rank 0 are sent to the workers in the same order, before any step that
uses them.

Collectives go through `torch.distributed` (NCCL between GPUs, gloo on CPUs); messages through
a gloo group. A worker that dies is noticed at once (`engine.parallel.workers.Workers`): the engine
logs it and refuses every later step (`RankDied`), so a server goes not-ready instead of
hanging.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.config import ModelConfig, ResolvedConfig
from lora.adapter import LoraAdapter
from lora.slots import LoraSlots, PackedAdapter

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

    inputs: Any  # engine.runner.step_inputs.StepInputs
    fed: int


@dataclass(frozen=True)
class LoadSlot:
    slot: int
    adapter: LoraAdapter  # host tensors, whole: each worker cuts its shard
    starts: dict[str, int]  # where rank 0 placed it: fused projection -> first pool row


STOP = "stop"


def rank_fingerprint(cfg: ModelConfig, model_dir: Path, model: torch.nn.Module
                     ) -> dict[str, Any]:
    """What the ranks must agree on: the model's shape and files, the torch build, and the
    final norm's weights (replicated on every rank: a differing checkpoint shows there).
    `model`: an `engine.runner.models.llama.LlamaForCausalLM` (typed as a module: the models import
    this file's `TPGroup`, not the other way round)."""
    config = model_dir / "config.json"
    norm = model.get_parameter("norm.weight").detach()
    return {
        "model": asdict(cfg),
        "config.json": hashlib.sha256(config.read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "dtype": str(norm.dtype),
        "norm": hashlib.sha256(norm.float().cpu().numpy().tobytes()).hexdigest(),
    }



class SentSlots(LoraSlots):
    """Rank 0's adapter slots: an adapter loaded into a slot is sent to the workers' slots
    too, with the rows rank 0 placed it at, in order with the steps (a later step may use
    it)."""

    def __init__(self, *args: Any, tp: TPGroup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp

    def load(self, slot: int, adapter: LoraAdapter, packed: PackedAdapter | None = None) -> None:
        super().load(slot, adapter, packed)
        self.tp.send(LoadSlot(slot, adapter, self.placement(slot)))

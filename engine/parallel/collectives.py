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
shared memory (`engine.parallel.channel`). A worker that dies is noticed at once
(`engine.parallel.workers.Workers`): the engine logs it and refuses every later step
(`RankDied`), so a server goes not-ready instead of hanging.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.config import ModelConfig, ResolvedConfig
from engine.parallel.channel import ShmChannel
from lora.adapter import LoraAdapter
from lora.slots import LoraSlots, PackedAdapter

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank stuck this long fails the step
IDLE_TIMEOUT = timedelta(days=365)  # gloo's start-up exchanges: a rank may load for long
ONE_SHOT_BYTES = 1 << 20  # with the one-shot all-reduce on: messages up to this size use it


class RankDied(RuntimeError):
    """A tensor-parallel worker exited: the engine cannot run another step."""


class TPGroup:
    """This process's rank in the tensor-parallel group, and the collectives the model uses."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        # Tensors go through the default group (NCCL on GPUs); rank 0's messages through
        # shared memory (`ShmChannel`), whose name goes over a gloo group of their own (as do
        # the start-up's `gather_objects`).
        self.cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._one_shot: torch.Tensor | None = None  # `enable_one_shot`'s buffer
        self._aborted = False
        channel = ShmChannel.create(size - 1) if rank == 0 else None
        box = [channel.name if channel else ""]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        self.channel = channel or ShmChannel.attach(str(box[0]), size - 1, rank - 1)

    def enable_one_shot(self, dtype: torch.dtype, hidden: int) -> None:
        """With `SWITCHBOARD_TP_ONE_SHOT=1`, on GPUs: all-reduce up to `ONE_SHOT_BYTES` (a
        decode step's activations) through symmetric memory: each rank copies its part into
        a buffer every peer maps and reads and sums all of them in one kernel (torch's
        `symm_mem.one_shot_all_reduce`), in the ranks' order on every rank, so all get the
        same bits. Off by default: a step's collectives alone, in a graph, take half NCCL's
        time (0.74 vs 1.45 ms for an 8B model's at batch 64 on two H200s), but inside the
        decode step its kernels take as long as NCCL's (0.64 vs 0.65 ms a step: +1.5%,
        benchmarks/results/h200_tp.md), and a second engine made in the same process after
        the first closed hung in its rendezvous. Collective: every rank calls it at the
        same point; where one cannot, none uses it."""
        if self.device.type != "cuda" or self.size == 1:
            return
        buf, why = None, "off (SWITCHBOARD_TP_ONE_SHOT=1 turns it on)"
        if os.environ.get("SWITCHBOARD_TP_ONE_SHOT", "0") == "1":
            try:
                import torch.distributed._symmetric_memory as symm_mem

                rows = max(1, ONE_SHOT_BYTES // (hidden * torch.finfo(dtype).bits // 8))
                buf = symm_mem.empty(rows * hidden, dtype=dtype, device=self.device)
                symm_mem.rendezvous(buf, self._world_name())
            except Exception as e:  # noqa: BLE001 - any failure: NCCL alone, on every rank
                buf, why = None, f"{type(e).__name__}: {e}"
        if all(self.gather_objects(buf is not None)):
            self._one_shot = buf
        elif self.rank == 0:
            log.info("tensor parallelism: all-reduce through NCCL (one-shot: %s)", why)

    @classmethod
    def join(cls, rank: int, size: int, port: int, device: torch.device) -> TPGroup:
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process")
        # A failed or timed-out collective aborts the communicators and raises in the step,
        # instead of ending the process (torch's default): rank 0 reports the rank that died.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, size, device)

    @staticmethod
    def _world_name() -> Any:
        world = dist.group.WORLD
        assert world is not None, "joined"
        return world.group_name

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks (in place, or a new tensor: use the result)."""
        buf = self._one_shot
        if buf is not None and x.numel() <= buf.numel() and x.dtype == buf.dtype:
            staged = buf[: x.numel()]
            staged.copy_(x.reshape(-1))
            out = torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self._world_name())
            return out.view(x.shape)
        dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on each rank -> [N, size * C], rank r's columns r*C..(r+1)*C."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    def send(self, message: Any) -> None:
        """Rank 0: send a message (any picklable object) to every worker, in order. Returns
        at once unless the workers are several messages behind; raises ChannelClosed once
        the group is aborted while it waits for them."""
        self.channel.send(message, alive=lambda: not self._aborted,
                          timeout=COLLECTIVE_TIMEOUT.total_seconds())

    def recv(self) -> Any:
        """A worker: the next message rank 0 sends."""
        return self.channel.recv()

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place; no host sync on GPUs)."""
        dist.broadcast(x, src=0)
        return x

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def abort(self) -> None:
        """A peer died: end this rank's communicators now, so a collective waiting for the
        peer on the GPU returns and the step fails, and later ones raise. (On CPUs gloo
        raises by itself once the peer's sockets close.) A `send` waiting for the workers
        to read gives up."""
        self._aborted = True
        if self.device.type == "cuda" and dist.is_initialized():
            dist.distributed_c10d._abort_process_group()

    def close(self, timeout: float = 30.0) -> None:
        """Leave the group (every rank does, about together). Bounded: a teardown stuck on a
        dead peer is abandoned after `timeout` seconds, logged, so closing never hangs."""
        self.channel.close()
        if not dist.is_initialized():
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        leaving = threading.Thread(target=dist.destroy_process_group, name="tp-close",
                                   daemon=True)
        leaving.start()
        leaving.join(timeout)
        if leaving.is_alive():
            log.error("rank %d: the tensor-parallel group did not close within %.0f s; "
                      "abandoned", self.rank, timeout)


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


@dataclass(frozen=True)
class KVOffload:
    """The host KV tier (`SentHostKV`): copy device pages to host pages, each rank its heads."""

    device_pages: list[int]
    host_pages: list[int]


@dataclass(frozen=True)
class KVLoad:
    """The host KV tier: copy host pages back into device pages, each rank its heads."""

    host_pages: list[int]
    device_pages: list[int]


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



class SentHostKV:
    """Rank 0's host KV tier (`engine.kv.tiers.HostKV`): each rank keeps its own heads' share
    of every host page in its own pool, at the same page ids, and the copies rank 0 queues are
    sent to the workers in order with the steps, which queue the same copies on their devices.

    Every load is overlapped (`HostKVPool.load`): each rank's forwards wait for each layer's
    copy before that layer, in a CUDA graph too. Rank 0 cannot see when a worker's copy is
    done, so no rank may skip a wait; and the ranks must take the same path (graph or eager,
    whose collectives differ in size), which a load `use`d on one rank only would break."""

    def __init__(self, pool: Any, tp: TPGroup) -> None:  # pool: engine.kv.host.HostKVPool
        self.pool, self.tp = pool, tp
        self.num_pages = pool.num_pages

    def offload(self, device_pages: list[int], host_pages: list[int]) -> None:
        self.pool.offload(device_pages, host_pages)
        self.tp.send(KVOffload(device_pages, host_pages))

    def load(self, host_pages: list[int], device_pages: list[int], overlap: bool = False) -> Any:
        handle = self.pool.load(host_pages, device_pages, overlap=True)
        self.tp.send(KVLoad(host_pages, device_pages))
        return handle

    def done(self, handle: Any) -> bool:
        return bool(self.pool.done(handle))

    def use(self, handle: Any) -> None:
        self.pool.use(handle)  # a no-op: every load is overlapped

    def copy_stats(self) -> Any:
        return self.pool.copy_stats()

    # The disk tier (engine/parallel/disk.py sends the workers their part of its work).
    def snapshot(self, device_pages: list[int]) -> Any:
        return self.pool.snapshot(device_pages)

    def host_writes_done(self) -> Any:
        return self.pool.host_writes_done()

    def store(self, host_page: int, page: Any) -> None:
        self.pool.store(host_page, page)


def run_host_kv(pool: Any, msg: KVOffload | KVLoad) -> None:
    """A worker: queue rank 0's host-tier copy on this rank's pool (`SentHostKV`)."""
    if isinstance(msg, KVOffload):
        pool.offload(msg.device_pages, msg.host_pages)
    else:
        pool.load(msg.host_pages, msg.device_pages, overlap=True)


class SentSlots(LoraSlots):
    """Rank 0's adapter slots: an adapter loaded into a slot is sent to the workers' slots
    too, with the rows rank 0 placed it at, in order with the steps (a later step may use
    it)."""

    def __init__(self, *args: Any, tp: TPGroup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp

    keeps_source = True  # the workers cut their shards from the whole adapter

    def load(self, slot: int, adapter: LoraAdapter | PackedAdapter) -> None:
        packed = adapter if isinstance(adapter, PackedAdapter) else self.pack(adapter)
        assert packed.source is not None
        super().load(slot, packed)
        self.tp.send(LoadSlot(slot, packed.source, self.placement(slot)))

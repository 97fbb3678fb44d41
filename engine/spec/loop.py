"""The overlapped speculative loop: steps whose decodes verify drafts, each queued on the device
before the host has read what the step before it accepted.

A synchronous speculative step (engine/spec/steps.py `SpeculativeStep`) drafts on the host from
the tokens the host has, so the device idles while the host reads a step's tokens, appends them,
drafts and launches the next one: at batch 16 on an H100, a sixth of the step. Here the
sequences' tokens are kept on the device as well (`DraftLoop.tokens`): the drafter proposes
there (`DeviceDrafter.propose_on_device`, from the host's hints where it makes them), the
step's inputs are built there, and its draws are compared with its drafts there, which appends
the accepted tokens and advances each sequence.
The host reads a step's draws and drafts while the device computes the next step, and runs them
through the stop checks exactly as after a synchronous step (engine/spec/steps.py
`advance_drafted`).

Every sequence verifies k drafts each step (a step's shape is fixed on the device); where the
drafter has no match it proposes a guess, which costs nothing a memory-bound step would notice.
What the host does not know when it queues a step it bounds: a sequence has at most 1 + k tokens
more than the host has seen, so its pages are reserved for the positions that could reach.
A request the host finds finished was computed one step too far; that row is dropped and the
loop goes on without it. When the loop ends is `DraftLoopStep.resume`'s decision.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.request import Request
from engine.core.scheduler import Batch
from engine.runner.model_runner import ModelRunner, Step, flat_tables
from engine.runner.verify_graphs import VerifyFed
from engine.spec.speculative import DeviceDrafter
from kernels.spec_decode import accept, verify_inputs
from kernels.upload import to_host, upload

HEADROOM = 1024  # tokens a sequence may grow by before the loop must start over, wider
SLACK = 2e-4  # seconds a step's host must wait on the device, on average, to draft hints
DECAY = 0.8  # the weight of the past in the averages of `HintGate`


class HintGate:
    """Whether the host drafts hints (`SuffixDrafter.hints`) as it queues a step. They cost
    the host time (on a 2-core CPU, 27 us a step at batch 1 and 133 us at batch 4) and add a
    dozen small kernels to the step; while the device computes a step longer than the host
    prepares one, that is free, and more drafts are accepted. Where the host is the
    bottleneck (a small model's step on a GPU: SmolLM2's on an H200 is mostly host time,
    benchmarks/results/suffix_decoding_h200.md), it is not.

    The gate reads how long the host waited for each step's draws. Hints stay on while that
    averages over `SLACK`; once off, they come back when the wait exceeds what they cost (as
    last measured) by `SLACK`. On a CPU the forward runs as the step is queued, and nothing is
    waited for: there they stay on."""

    def __init__(self) -> None:
        self.on = True
        self.wait = SLACK  # the averages, in seconds
        self.cost: float | None = None

    def update(self, waited: float, hint_seconds: float | None) -> None:
        """A step was read after `waited` seconds; drafting its hints took `hint_seconds`
        (None: it had none)."""
        self.wait = DECAY * self.wait + (1 - DECAY) * waited
        if hint_seconds is not None:
            self.cost = hint_seconds if self.cost is None else (
                DECAY * self.cost + (1 - DECAY) * hint_seconds)
        if self.on:
            self.on = self.wait >= SLACK
        else:
            self.on = self.wait >= (self.cost or 0.0) + SLACK


@dataclass
class LoopStep:
    """A launched step of the loop: its draw is queued, its drafts on their way to the host."""

    step: Step  # its rows: each request `1 + k` times, one per position
    reqs: list[Request]  # in row order
    # (S, k + 1) in (pinned) host memory once the step's draw has arrived: each sequence's
    # drafts, then how many of them lead that were looked up (`DeviceDrafter`)
    drafts: torch.Tensor
    hint_seconds: float | None = None  # with hints: the host's time proposing its drafts


class DraftLoop:
    """The loop's sequences on the device: their tokens, lengths and prompt lengths."""

    def __init__(self, reqs: list[Request], k: int, drafter: DeviceDrafter,
                 device: torch.device):
        self.k, self.drafter, self.device = k, drafter, device
        self.reqs = reqs
        longest = max(r.num_tokens for r in reqs)
        self.width = -(-(longest + HEADROOM) // 256) * 256
        tokens = np.zeros((len(reqs), self.width), np.int64)
        for i, r in enumerate(reqs):
            tokens[i, : r.num_tokens] = r.token_ids
        self.tokens = torch.from_numpy(tokens).to(device)
        self.lengths, self.prompt_lens = upload(
            [[r.num_tokens for r in reqs], [r.num_prompt_tokens for r in reqs]], torch.long,
            device)

    def room(self, req: Request, in_flight: bool) -> bool:
        """Whether the next step's writes fit `req`'s row: its tokens on the device are at most
        1 + k past the host's (`in_flight`), and the step appends up to 1 + k more."""
        q = self.k + 1
        return req.num_tokens + (2 * q if in_flight else q) <= self.width

    def launch(self, runner: ModelRunner, reqs: list[Request], hinted: bool = True) -> LoopStep:
        """Queue a step of `reqs` (the loop's requests, in order, less those the host saw
        finish) verifying k drafts each; their pages must cover the positions it computes.
        `hinted`: with the drafter's hints, where it makes them (`HintGate`)."""
        if reqs != self.reqs:
            staying = set(reqs)
            keep = [i for i, r in enumerate(self.reqs) if r in staying]
            kept = upload([keep], torch.long, self.device)[0]
            self.tokens, self.lengths, self.prompt_lens = (
                t.index_select(0, kept) for t in (self.tokens, self.lengths, self.prompt_lens))
            self.reqs = reqs
        s, q = len(reqs), self.k + 1
        hints = getattr(self.drafter, "hints", None) if hinted else None
        start = time.perf_counter()
        drafts, looked = self.drafter.propose_on_device(
            self.tokens, self.lengths, self.k, hints(reqs, self.k) if hints else None)
        hint_seconds = time.perf_counter() - start if hints else None
        host_drafts = to_host(torch.cat([drafts, looked.unsqueeze(1)], dim=1))
        tables = upload([flat_tables([r.pages for r in reqs])], torch.int32,
                        self.device)[0].view(s, -1)
        ids, positions, slots, outputs, lens = verify_inputs(
            self.tokens, self.lengths, self.prompt_lens, drafts, tables, runner.page_size)
        fed = VerifyFed(ids, positions, slots, lens, tables, [r.lora_slot for r in reqs])
        logits = runner.verify(fed)
        rows = [r for r in reqs for _ in range(q)]
        step = Step(Batch(), rows, logits)
        # Each position's noise is that of its token's index in the output, as without drafts.
        runner.sample(step, rows, offsets=list(range(q)) * s, positions=outputs)
        assert step.drawn is not None
        accept(self.tokens, self.lengths, drafts, step.drawn.tokens.view(s, q))
        return LoopStep(step, reqs, host_drafts, hint_seconds)

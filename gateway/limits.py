"""Admission control: the bounded engine queue and per-tenant limits.

Everything here runs on the event loop, so plain counters suffice. A refused request gets a
429 with `Retry-After` at once; nothing queues without bound.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable

from gateway.config import TenantLimits
from gateway.errors import bad_request, rate_limited

WINDOW_S = 60.0


def check_capacity(outstanding: int, new: int, max_num_seqs: int, max_queue: int) -> None:
    """Refuse when the engine already holds a full batch plus a full queue of sequences."""
    capacity = max_num_seqs + max_queue
    if new > capacity:
        raise bad_request(f"the request needs {new} sequences; the server holds at most "
                          f"{capacity}", "n")
    if outstanding + new > capacity:
        raise rate_limited("The server is at capacity; retry shortly.", 1.0, "queue_full")


class Ticket:
    """A tenant's admitted request; `release()` (idempotent) frees its concurrency slot."""

    def __init__(self, limiter: TenantLimiter, tenant: str):
        self.limiter, self.tenant = limiter, tenant
        self._released = False

    def record_tokens(self, n: int) -> None:
        self.limiter.record_tokens(self.tenant, n)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.limiter.active[self.tenant] -= 1


class TenantLimiter:
    """Max concurrent requests and tokens per minute, per tenant.

    Tokens are prompt tokens (counted at admission) plus generated tokens (as they stream),
    over a sliding 60 s window. A request is admitted while the window is under the limit.
    """

    def __init__(
        self,
        limits_for: Callable[[str], TenantLimits],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limits_for = limits_for
        self.clock = clock
        self.active: dict[str, int] = defaultdict(int)
        self._window: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self._used: dict[str, int] = defaultdict(int)

    def admit(self, tenant: str) -> Ticket:
        lim = self.limits_for(tenant)
        if lim.max_concurrent_requests is not None:
            if self.active[tenant] >= lim.max_concurrent_requests:
                raise rate_limited(
                    f"Tenant '{tenant}' already has {self.active[tenant]} requests in flight "
                    f"(limit {lim.max_concurrent_requests}).", 1.0, "concurrency_limit_exceeded"
                )
        if lim.tokens_per_minute is not None:
            used = self.tokens_used(tenant)
            if used >= lim.tokens_per_minute:
                raise rate_limited(
                    f"Tenant '{tenant}' used {used} tokens in the last minute "
                    f"(limit {lim.tokens_per_minute}).",
                    self._seconds_until_below(tenant, lim.tokens_per_minute),
                    "tokens_per_minute_exceeded",
                )
        self.active[tenant] += 1
        return Ticket(self, tenant)

    def record_tokens(self, tenant: str, n: int) -> None:
        if n > 0 and self.limits_for(tenant).tokens_per_minute is not None:
            self._window[tenant].append((self.clock(), n))
            self._used[tenant] += n

    def tokens_used(self, tenant: str) -> int:
        window, cutoff = self._window[tenant], self.clock() - WINDOW_S
        while window and window[0][0] <= cutoff:
            self._used[tenant] -= window.popleft()[1]
        return self._used[tenant]

    def _seconds_until_below(self, tenant: str, limit: int) -> float:
        used, now = self._used[tenant], self.clock()
        for t, n in self._window[tenant]:
            used -= n
            if used < limit:
                return t + WINDOW_S - now
        return WINDOW_S

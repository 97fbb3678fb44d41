"""The storage ledger (gateway/access/quota.py) on both implementations: quotas on sessions,
bytes and one history's bytes; a refused change applies nothing; drops, expiry, reservations;
concurrent replicas never pass a quota together (a real redis-server)."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_sessions import redis_server, redis_url  # noqa: F401 - module-scoped fixtures

from gateway import redis_store
from gateway.access.quota import (
    OVERHEAD,
    MemoryLedger,
    QuotaExceeded,
    RedisLedger,
    Reservation,
    StorageQuota,
)

QUOTA = StorageQuota(max_sessions=3, max_bytes=10 * OVERHEAD, max_history_bytes=4 * OVERHEAD)


@pytest.fixture(params=["memory", "redis"])
def make_ledger(request: pytest.FixtureRequest):
    """Builds the ledger inside the test's event loop (the Redis client binds to it)."""
    if request.param == "memory":
        return MemoryLedger
    url = request.getfixturevalue("redis_url")
    return lambda: RedisLedger(redis_store.connect(url))


def _tenant() -> str:
    return f"t{time.monotonic_ns()}"  # a fresh tenant per test: the Redis is shared


def test_session_count_and_bytes(make_ledger) -> None:
    async def main() -> None:
        ledger, t = make_ledger(), _tenant()
        for i in range(3):
            await ledger.apply(t, {f"s:{i}": 10}, 60, QUOTA)
        with pytest.raises(QuotaExceeded) as e:
            await ledger.apply(t, {"s:3": 10}, 60, QUOTA)
        assert e.value.quota == "max_sessions"
        assert await ledger.usage(t) == (3, 3 * (OVERHEAD + 10))
        await ledger.apply(t, {"r:1": 10}, 60, QUOTA)  # records are not sessions
        await ledger.drop(t, "s:0")
        await ledger.apply(t, {"s:3": 10}, 60, QUOTA)  # a slot freed
        assert (await ledger.usage(t))[0] == 3
        # Bytes: 4 entries of OVERHEAD + 10 are stored; 10 * OVERHEAD is the quota.
        with pytest.raises(QuotaExceeded) as e:
            await ledger.apply(t, {"r:2": 3 * OVERHEAD, "r:3": 3 * OVERHEAD}, 60, QUOTA)
        assert e.value.quota == "max_storage_bytes"
        assert await ledger.usage(t) == (3, 4 * (OVERHEAD + 10))  # nothing applied
        # One history past max_history_bytes, though the tenant has room.
        await ledger.drop(t, "r:1", "s:1")
        with pytest.raises(QuotaExceeded) as e:
            await ledger.apply(t, {"s:3": 4 * OVERHEAD}, 60, QUOTA)
        assert e.value.quota == "max_history_bytes"
        # Unchecked (a settle) always applies; shrinking never fails.
        await ledger.apply(t, {"s:3": 4 * OVERHEAD}, 60)
        await ledger.apply(t, {"s:3": -4 * OVERHEAD}, 60, QUOTA)
        assert await ledger.usage(t) == (2, 2 * (OVERHEAD + 10))

    asyncio.run(main())


def test_replace_and_expiry(make_ledger) -> None:
    async def main() -> None:
        ledger, t = make_ledger(), _tenant()
        await ledger.apply(t, {"c:1": 100}, 60, QUOTA)
        await ledger.apply(t, {"c:1": 40}, 60, QUOTA, drops=["c:1"])  # a record rewritten
        assert await ledger.usage(t) == (0, OVERHEAD + 40)
        await ledger.apply(t, {"s:short": 5}, 1, QUOTA)
        assert (await ledger.usage(t))[0] == 1
        await asyncio.sleep(1.2)
        await ledger.apply(t, {"r:x": 1}, 60, QUOTA)  # any change purges expired entries
        assert await ledger.usage(t) == (0, 2 * OVERHEAD + 41)

    asyncio.run(main())


def test_reservation_settles_or_releases(make_ledger) -> None:
    async def main() -> None:
        ledger, t = make_ledger(), _tenant()
        await ledger.apply(t, {"s:a": 100}, 60, QUOTA)
        turn = await Reservation(ledger, t, "s:a", 500, 60).take(QUOTA)
        assert await ledger.usage(t) == (1, OVERHEAD + 600)
        await turn.settle({"s:a": 120}, 60)  # wrote 120 bytes, not the 500 reserved
        assert await ledger.usage(t) == (1, OVERHEAD + 220)
        await turn.release()  # settled: nothing to give back
        assert await ledger.usage(t) == (1, OVERHEAD + 220)
        # A placeholder that may create a session counts as one until it is released.
        new = await Reservation(ledger, t, "sp:resp_1", 50, 60).take(QUOTA)
        assert (await ledger.usage(t))[0] == 2
        await new.release()
        assert await ledger.usage(t) == (1, OVERHEAD + 220)
        # Settled into the entries the commit wrote.
        new = await Reservation(ledger, t, "sp:resp_2", 50, 60).take(QUOTA)
        await new.settle({"s:b": 70, "r:resp_2": 30}, 60)
        assert await ledger.usage(t) == (2, 3 * OVERHEAD + 220 + 100)

    asyncio.run(main())


def test_concurrent_replicas_never_pass_the_quota_together(redis_url: str) -> None:  # noqa: F811
    """Eight clients (as eight replicas) race 40 session creates against a quota of 3."""

    async def main() -> None:
        ledgers, t = [RedisLedger(redis_store.connect(redis_url)) for _ in range(8)], _tenant()

        async def create(i: int) -> bool:
            try:
                await ledgers[i % 8].apply(t, {f"s:{i}": 10}, 60, QUOTA)
                return True
            except QuotaExceeded:
                return False

        taken = await asyncio.gather(*(create(i) for i in range(40)))
        assert sum(taken) == 3
        assert await ledgers[0].usage(t) == (3, 3 * (OVERHEAD + 10))

    asyncio.run(main())

"""Per-tenant adapter quotas: how many adapters a tenant may store, and how many bytes of files.

The gateway checks an upload against its tenant's quota before writing anything, while it holds
that tenant's upload lock; with a shared registry the Redis script that registers the upload
checks again, atomically across replicas (gateway/adapters/store.py). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass


class QuotaExceeded(Exception):
    """An upload past its tenant's adapter quota; the message says which limit and the usage."""


@dataclass(frozen=True)
class AdapterQuota:
    max_adapters: int
    max_bytes: int  # of the adapters' stored files, all of them together

    def problem(self, count: int, used: int, incoming: int) -> str | None:
        """Why one more adapter of `incoming` bytes does not fit beside `count` adapters of
        `used` bytes (None: it fits)."""
        if count + 1 > self.max_adapters:
            return (f"adapter quota exceeded: the tenant stores {count} adapters, the most it "
                    f"may store is {self.max_adapters}; delete one first")
        if used + incoming > self.max_bytes:
            return (f"adapter storage quota exceeded: the tenant's adapters take {used} bytes, "
                    f"this upload {incoming} more, over the quota of {self.max_bytes} bytes; "
                    "delete adapters first")
        return None

    def check(self, count: int, used: int, incoming: int) -> None:
        """Raise `QuotaExceeded` unless one more adapter of `incoming` bytes fits."""
        why = self.problem(count, used, incoming)
        if why is not None:
            raise QuotaExceeded(why)

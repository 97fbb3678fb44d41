"""Free-page allocator for the paged KV pool. Pure Python: page ids are integers.

The KV tensors themselves live in the model runner; this only tracks which pages are free.
"""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    pass


class PageAllocator:
    """Hands out page ids `0..num_pages-1`.

    Contract: a page returned by `allocate` belongs to the caller until it passes it to `free`;
    freeing a page twice or a page that was never allocated raises.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives low ids first
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise RuntimeError(f"page {p} does not exist")
            if self._is_free[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._is_free[p] = True
            self._free.append(p)

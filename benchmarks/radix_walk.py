"""The radix tree's walk (`sessions.forest.Forest.walk`) over a session's 4k-token history: a
cached turn's full match, and a divergence mid-node (which splits it). Host time per walk;
a turn walks twice (the match at admission, the insert when it ends).

    python benchmarks/radix_walk.py
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sessions.forest import Forest, RadixNode  # noqa: E402

PAGE, HISTORY, TURN = 16, 4160, 80


def tree(key: tuple[int, ...]) -> tuple[Forest, RadixNode]:
    forest = Forest(PAGE)
    root = forest.roots.setdefault("ns", RadixNode((), [], None))
    node = RadixNode(key, list(range(len(key) // PAGE)), root)
    root.children[key[:PAGE]] = node
    return forest, node


def main() -> None:
    rng = random.Random(0)
    hist = [rng.randrange(49152) for _ in range(HISTORY)]
    key = tuple(hist)
    turn = hist + [rng.randrange(49152) for _ in range(TURN)]
    forest, node = tree(key)
    full = []
    for _ in range(200):
        t = time.perf_counter()
        path, pos = forest.walk("ns", turn)
        full.append(time.perf_counter() - t)
        assert pos == HISTORY and path == [node]
    split = []
    diverged = hist[:2000] + [-1] + hist[2001:]
    for _ in range(50):
        forest, _ = tree(key)
        t = time.perf_counter()
        _, pos = forest.walk("ns", diverged)
        split.append(time.perf_counter() - t)
        assert pos == 2000, pos
    print(f"full match {statistics.median(full) * 1e6:.1f} us, "
          f"divergence at token 2000 {statistics.median(split) * 1e6:.1f} us")


if __name__ == "__main__":
    main()

"""GrammarCompiler: specs -> compiled grammars, off the engine's critical path.

Each compile runs in a worker subprocess (see worker.py) under a wall-time and a memory cap,
trying the backends in order until one succeeds. Results are cached by
(spec hash, tokenizer fingerprint) in an LRU of futures, so concurrent requests for the same
spec share one compilation, and a spec that failed is refused at once the next time.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from grammar.backend import BACKEND_NAMES, Backend, CompiledGrammar, make_backend
from grammar.spec import ConstraintSpec, GrammarError
from grammar.vocab import TokenVocab
from grammar.worker import CompileWorker


class GrammarCompiler:
    """Compiles constraint specs for one tokenizer.

    Args:
        tokenizer: a HF tokenizer.
        vocab_size: the model's embedding rows (may exceed `len(tokenizer)`); bitmasks are
            [batch, ceil(vocab_size / 32)].
        backends: the fallback order; each is tried when the previous one fails.
        num_workers: compile subprocesses (and so compilations in flight).
        timeout_s: wall-time cap per backend attempt.
        memory_limit_mb: address space a compilation may add in its worker (None: no cap).
        stop_token_ids: tokens that end a constrained output (default: the tokenizer's EOS).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        backends: Sequence[str] = BACKEND_NAMES,
        num_workers: int = 1,
        timeout_s: float = 10.0,
        memory_limit_mb: int | None = 2048,
        cache_size: int = 512,
        stop_token_ids: list[int] | None = None,
    ):
        if not backends:
            raise ValueError("need at least one grammar backend")
        self.vocab = TokenVocab.from_tokenizer(tokenizer, vocab_size, stop_token_ids)
        self.backends = tuple(backends)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        # Parent-side copies only load artifacts; compiling happens in the workers.
        self._loaders: dict[str, Backend] = {}
        self._missing: dict[str, str] = {}  # optional libraries that are not installed
        for name in self.backends:
            try:
                self._loaders[name] = make_backend(name, self.vocab)
            except ImportError as e:
                self._missing[name] = f"not installed ({e})"
        self._workers = [
            CompileWorker(self.vocab, memory_limit_mb, list(self._loaders))
            for _ in range(num_workers)
        ]
        self._idle: queue.Queue[CompileWorker] = queue.Queue()
        for w in self._workers:
            w.start()  # import in the background; the first compile waits for it
            self._idle.put(w)
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    @property
    def worker_pids(self) -> list[int | None]:
        """The compile subprocesses' pids (None: not running); for ops and tests."""
        return [w.pid for w in self._workers]

    def submit(self, spec: ConstraintSpec) -> Future[CompiledGrammar]:
        """Start compiling `spec` (or find it in the cache); never blocks.

        The future resolves to a CompiledGrammar, or raises GrammarError naming why no
        backend could compile the spec (unsupported feature, syntax error, time or memory
        cap). Failures are cached like successes.
        """
        key = (spec.key, self.vocab.fingerprint)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        """Blocking `submit`: for tools and tests."""
        return self.submit(spec).result()

    def close(self) -> None:
        """Stop the worker subprocesses: an in-flight compilation finishes, queued ones are
        cancelled."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for w in self._workers:
            w.stop()

    def __enter__(self) -> GrammarCompiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        worker = self._idle.get()
        try:
            errors, failed_ms = [], 0.0
            for name in self.backends:
                if name in self._missing:
                    errors.append(f"{name}: {self._missing[name]}")
                    continue
                t0 = time.perf_counter()
                try:
                    artifact, ms = worker.compile(name, spec, self.timeout_s)
                    t1 = time.perf_counter()
                    factory = self._loaders[name].load(artifact)
                except Exception as e:  # BackendError, or an artifact that fails to load
                    errors.append(f"{name}: {e}")
                    failed_ms += (time.perf_counter() - t0) * 1e3
                    continue
                # The time to a usable grammar: failed attempts, compiling, and loading.
                ms += failed_ms + (time.perf_counter() - t1) * 1e3
                return CompiledGrammar(spec, name, ms, factory)
        finally:
            self._idle.put(worker)
        what = "JSON schema" if spec.kind == "json_schema" else f"{spec.kind} constraint"
        raise GrammarError(f"cannot compile this {what}: " + "; ".join(errors), spec.param)

"""GrammarCompiler: specs -> compiled grammars, off the engine's critical path.

Each compile runs in a worker subprocess (see worker.py) under a wall-time and a memory cap,
trying the backends in order until one succeeds (a spec no output satisfies stops the chain).
Results are cached by (spec hash, tokenizer fingerprint) in an LRU of futures, so concurrent
requests for the same spec share one compilation, and a spec that failed is refused at once the
next time. The cache is bounded by entries and by bytes: an entry costs its spec's text and
its grammar's estimated memory.

What the caller's process does per spec: `submit` hashes it; a pool thread waits on the worker,
unpickles the artifact (at most `max_artifact_bytes`) and loads it (native code that drops the
GIL; the worker loaded the same artifact within the time cap first).
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

from grammar.backend import Backend, CompiledGrammar, Unsatisfiable
from grammar.backends import BACKEND_NAMES, make_backend
from grammar.normalize import normalize_spec
from grammar.spec import ConstraintSpec, GrammarError
from grammar.vocab import TokenVocab
from grammar.worker import MAX_ARTIFACT_BYTES, CompileWorker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TRIM_AFTER_BYTES = 1 << 20  # artifacts whose load is followed by returning freed heap to the OS


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
        max_artifact_bytes: a larger compiled grammar is refused (this process unpickles it
            holding the GIL, and loading it peaks at several times its size).
        cache_size: cached specs, compiled or failed.
        cache_bytes: their estimated memory (`CompiledGrammar.nbytes` plus the spec's text).
        stop_token_ids: tokens that end a constrained output (default: the tokenizer's EOS).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        *,
        backends: Sequence[str] = BACKEND_NAMES,
        num_workers: int = 1,
        timeout_s: float = 10.0,
        memory_limit_mb: int | None = 2048,
        max_artifact_bytes: int = MAX_ARTIFACT_BYTES,
        cache_size: int = 512,
        cache_bytes: int = 256 << 20,
        stop_token_ids: list[int] | None = None,
    ):
        if not backends:
            raise ValueError("need at least one grammar backend")
        self.vocab = TokenVocab.from_tokenizer(tokenizer, vocab_size, stop_token_ids)
        self.backends = tuple(backends)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        # Parent-side copies only load artifacts; compiling happens in the workers.
        self._loaders: dict[str, Backend] = {}
        self._missing: dict[str, str] = {}  # optional libraries that are not installed
        for name in self.backends:
            try:
                self._loaders[name] = make_backend(name, self.vocab)
            except ImportError as e:
                self._missing[name] = f"not installed ({e})"
        self._workers = [
            CompileWorker(self.vocab, memory_limit_mb, list(self._loaders), max_artifact_bytes)
            for _ in range(num_workers)
        ]
        self._idle: queue.Queue[CompileWorker] = queue.Queue()
        for w in self._workers:
            w.start()  # import in the background; the first compile waits for it
            self._idle.put(w)
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # cache key -> its estimated bytes
        self.cached_bytes = 0  # their sum
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
        cap, no output satisfies it). Failures are cached like successes.
        """
        key = (spec.key, self.vocab.fingerprint)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec, key)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._evict_oldest()
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

    def _compile(self, spec: ConstraintSpec, key: tuple[str, str]) -> CompiledGrammar:
        """Compile `spec`, then charge its cache entry (a failure keeps only the spec)."""
        try:
            # Every backend compiles the normalized schema; its contradictions stop here.
            grammar = replace(self._try_backends(normalize_spec(spec)), spec=spec)
        except GrammarError:
            self._charge(key, _text_bytes(spec))
            raise
        self._charge(key, _text_bytes(spec) + grammar.nbytes)
        return grammar

    def _try_backends(self, spec: ConstraintSpec) -> CompiledGrammar:
        what = "JSON schema" if spec.kind == "json_schema" else f"{spec.kind} constraint"
        worker = self._idle.get()
        try:
            errors, failed_ms = [], 0.0
            for name in self.backends:
                if name in self._missing:
                    errors.append(f"{name}: {self._missing[name]}")
                    continue
                t0 = time.perf_counter()
                try:
                    grammar = self._load(worker, name, spec)
                except Unsatisfiable as e:  # a property of the spec: no backend can do better
                    raise GrammarError(f"no output can satisfy this {what} ({name}: {e})",
                                       spec.param) from None
                except Exception as e:  # BackendError, or an artifact that fails to load
                    errors.append(f"{name}: {e}")
                    failed_ms += (time.perf_counter() - t0) * 1e3
                    continue
                # The time to a usable grammar: failed attempts, compiling, and loading.
                return replace(grammar, compile_ms=grammar.compile_ms + failed_ms)
        finally:
            self._idle.put(worker)
        raise GrammarError(f"cannot compile this {what}: " + "; ".join(errors), spec.param)

    def _load(self, worker: CompileWorker, name: str, spec: ConstraintSpec) -> CompiledGrammar:
        """One backend's attempt: compile in `worker`, load here. (A function of its own, so
        that no frame a cached failure keeps holds an artifact.)"""
        artifact, size, ms = worker.compile(name, spec, self.timeout_s)
        t0 = time.perf_counter()
        loader = self._loaders[name]
        factory = loader.load(artifact)
        del artifact  # before trimming: xgrammar's is JSON text the grammar no longer needs
        if size > TRIM_AFTER_BYTES:
            _trim_heap()
        ms += (time.perf_counter() - t0) * 1e3
        return CompiledGrammar(spec, name, ms, factory, int(size * loader.bytes_per_artifact_byte))

    def _charge(self, key: tuple[str, str], nbytes: int) -> None:
        """Set the cost of the settled cache entry `key` (entries cost nothing while they
        compile), then evict the least recently used entries while the cache is over budget.
        An entry over the whole budget is not kept. Requests holding an evicted future keep
        their grammar."""
        with self._lock:
            if key not in self._cache:  # evicted while it compiled
                return
            if nbytes > self.cache_bytes:  # not worth flushing everything else for
                del self._cache[key]
                self.cached_bytes -= self._sizes.pop(key, 0)
                return
            self.cached_bytes += nbytes - self._sizes.get(key, 0)
            self._sizes[key] = nbytes
            while self._cache and self.cached_bytes > self.cache_bytes:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        """Drop the least recently used cache entry. Call with the lock held."""
        old, _ = self._cache.popitem(last=False)
        self.cached_bytes -= self._sizes.pop(old, 0)


def _text_bytes(spec: ConstraintSpec) -> int:
    """Memory the spec's own text holds (cached failures keep only this)."""
    payload = spec.payload if isinstance(spec.payload, tuple) else (spec.payload or "",)
    return sum(len(p) for p in payload) + 256


def _trim_heap() -> None:
    """Give freed heap back to the OS. glibc keeps it otherwise: after loading one 22 MB
    xgrammar artifact the process stayed ~110 MiB larger, and grew with the largest load."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass

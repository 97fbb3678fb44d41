"""The event loop's side of an engine client, the same whether the core runs in a thread
(`AsyncEngine`) or in its own process (`EngineProcess`): one sink per request, commands out
through the subclass's `_send`, outputs in through `_deliver`. Pure Python, no torch."""

from __future__ import annotations

from engine.core.loop import Abort, Command, FailAll, ReleaseSession
from engine.messages import GenerateRequest, RequestOutput
from engine.protocols import Sink
from engine.sampling.params import InvalidRequestError


class SinkClient:
    """Subclasses define `_send` (into the core's inbox, or over the link) and call
    `super().__init__()`.
    Everything here runs on the event loop, except `fail_all` (any thread)."""

    def __init__(self) -> None:
        self._sinks: dict[str, Sink] = {}  # who listens for which request

    def _send(self, command: Command) -> None:
        raise NotImplementedError

    @property
    def num_outstanding(self) -> int:
        """Requests added and not yet finished (queued, waiting or running)."""
        return len(self._sinks)

    def add_request(self, request: GenerateRequest, sink: Sink) -> None:
        if request.request_id in self._sinks:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        self._sinks[request.request_id] = sink
        self._send(request)

    def abort(self, request_id: str) -> None:
        """Stop a request; its pages are freed before the next engine step."""
        if self._sinks.pop(request_id, None) is not None:
            self._send(Abort(request_id))

    def release_session(self, session_id: str) -> None:
        """The session ended: unpin its KV (applied before the next step)."""
        self._send(ReleaseSession(session_id))

    def fail_all(self, why: str) -> None:
        """Fail every request added and not finished (a drain's deadline passed): each gets a
        last output with finish_reason "error" and `error=why`."""
        self._send(FailAll(why))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # aborted by the gateway: nobody listens any more
            if out.finished:
                del self._sinks[out.request_id]
            sink.put_nowait(out)

"""Forwarding one request to one replica and relaying its answer, streams included.

The request body is read once (so a request whose connection was refused can go to another
replica: nothing reached the first); the answer streams back chunk by chunk as the replica
writes it, with `x-switchboard-replica` added. When the client leaves, the upstream response
is closed, which the replica sees as its own client leaving (it aborts the generation).
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.registry import ReplicaInfo

REPLICA_HEADER = "x-switchboard-replica"
# Per-connection headers (RFC 9110 section 7.6.1) and those the HTTP client sets itself.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "transfer-encoding", "upgrade", "host", "content-length"}


async def send(client: httpx.AsyncClient, replica: ReplicaInfo, request: Request,
               body: bytes) -> httpx.Response:
    """Open the replica's response (headers read, body not yet). Raises `httpx.ConnectError`
    / `httpx.ConnectTimeout` when the replica cannot be reached."""
    url = replica.url + request.url.path
    if request.url.query:
        url += "?" + request.url.query
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
    upstream = client.build_request(request.method, url, headers=headers, content=body)
    return await client.send(upstream, stream=True)


def response_headers(upstream: httpx.Response, replica: ReplicaInfo) -> dict[str, str]:
    drop = HOP_BY_HOP | {"date", "server"}  # the router's own server writes these
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in drop}
    headers[REPLICA_HEADER] = replica.address
    return headers


async def buffered(upstream: httpx.Response, replica: ReplicaInfo) -> Response:
    """The whole answer (for the routes whose body the router reads)."""
    try:
        content = await upstream.aread()
    finally:
        await upstream.aclose()
    return Response(content, upstream.status_code, response_headers(upstream, replica))


class Relay(StreamingResponse):
    """The replica's answer, chunk by chunk; `on_close` runs however the stream ends."""

    def __init__(self, upstream: httpx.Response, replica: ReplicaInfo,
                 on_close: Callable[[], None]):
        super().__init__(upstream.aiter_raw(), upstream.status_code,
                         response_headers(upstream, replica))
        self.upstream, self.on_close = upstream, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.upstream.aclose()
            self.on_close()

"""Reading a request body at the edge, for admission (gateway/admission.py) and the pass-through
(gateway/proxy/passthrough.py): the size limit and a client that leaves mid-body."""

from __future__ import annotations

from litestar import Request
from litestar.exceptions import InternalServerException

from kvscope.gateway.context import context_of
from kvscope.gateway.errors import ClientClosedRequest, PayloadTooLarge


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 when ``Content-Length`` (or the bytes read) exceed ``limit``; raises
    ClientClosedRequest (logged as 499) when the client leaves before the body ended."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Request body is {int(declared)} bytes; the limit is {limit} bytes.")
    ctx = context_of(request)
    try:
        body = await request.body()
    except InternalServerException:  # Litestar's "client disconnected prematurely" (http.disconnect)
        ctx.outcome.mark_disconnected("request_body")
        raise ClientClosedRequest("client closed the connection while sending the request body") from None
    ctx.request.body_bytes = len(body)
    return body

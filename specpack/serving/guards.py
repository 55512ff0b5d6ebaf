"""What `specpack serve` checks before a request reaches FastAPI: the API key, and the body size.

Both are pure ASGI middleware, so a refused request costs no parsing: a wrong key is answered
before the body is read, and a body over the limit before the rest of it is read.
"""

import hmac
import json

from specpack.schemas import openai as oa

_LEFT = object()  # the client went away while sending


async def _send_error(send, status: int, body: dict, headers: tuple = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


class RequireKey:
    """Pure ASGI middleware: every route but /health needs `Authorization: Bearer KEY`, compared
    in constant time; anything else gets 401 and OpenAI's error body."""

    OPEN = ("/health",)

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN or self._authorized(scope):
            return await self.app(scope, receive, send)
        await _send_error(send, 401, oa.error_body("missing or wrong API key: send the header "
                                                   "'Authorization: Bearer KEY'", code="invalid_api_key"),
                          ((b"www-authenticate", b"Bearer"),))

    def _authorized(self, scope) -> bool:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                given = given.strip() if scheme.lower() == b"bearer" else b""
        return hmac.compare_digest(given, self.key)


class LimitBody:
    """Pure ASGI middleware: reads the request body up to `max_bytes` and hands it on whole; a
    larger one (by its Content-Length, or counted as it streams in) gets 413 at once, unread."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = await self._read(scope, receive)
        if body is _LEFT:
            return
        if body is None:
            return await _send_error(send, 413, oa.error_body(
                f"the request body is larger than {self.max_bytes:,} bytes", code="request_too_large"))
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # what the server says next: a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, scope, receive):
        """The whole body; None as soon as it is known to be too large; _LEFT if the client left."""
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return None
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return _LEFT
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return None
            more = message.get("more_body", False)
        return b"".join(chunks)

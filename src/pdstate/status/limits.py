"""Request body limits for every route (ASGI middleware, ahead of the app)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from pdstate.status.models import BODY_LIMITS, MAX_BODY_BYTES


class BodyLimit:
    """ASGI middleware: refuse a request body over its route's limit with 413, before the app
    reads it. A ``Content-Length`` over the limit is refused at once (the body is never read and
    the connection is closed); a body without one is read here up to the limit, then handed to
    the app from memory (so nothing downstream reads an unbounded stream)."""

    def __init__(self, app, default: int = MAX_BODY_BYTES, limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.default = default
        self.limits = BODY_LIMITS if limits is None else limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.get(scope.get("path", ""), self.default)
        length = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = limit + 1  # the server rejects malformed framing first; never trust it here
        if length is not None and length > limit:
            await self._too_large(scope, receive, send, limit)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await self._too_large(scope, receive, send, limit)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(scope, receive, send, limit: int) -> None:
        response = JSONResponse(
            status_code=413,
            content={"detail": f"request body larger than {limit} bytes"},
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)

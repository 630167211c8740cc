"""The request body limit: an ASGI middleware that answers 413 for a body over the caller's limit (its key's
``max_body_bytes``, else the configured default) before the endpoint reads it all."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from sluicegate.api.errors import ApiError

from .auth import KeyRing, presented_key
from .errors import error_response


class BodyLimitMiddleware:
    """413 for bodies over the caller's limit (its key's ``max_body_bytes``, else ``max_bytes``): at once from
    ``Content-Length``, or as soon as a streamed (chunked) body grows past it."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        keyring: KeyRing | None = None,
        path_limits: Mapping[str, int] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.keyring = keyring
        # Paths with a limit of their own whatever the key (file uploads: OpenAI's 200 MB, not a prompt's 1 MB).
        self.path_limits = dict(path_limits or {})

    def limit_for(self, scope: Scope) -> int:
        """The body limit of the key the request presents (the default for none or an unknown one)."""
        if self.keyring is None:
            return self.max_bytes
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers", ())
            if name in (b"authorization", b"x-api-key")
        }
        presented = presented_key(headers)
        key = self.keyring.lookup(presented) if presented else None
        if key is None or key.limits.max_body_bytes is None:
            return self.max_bytes
        return key.limits.max_body_bytes

    @staticmethod
    def _too_large(limit: int) -> ApiError:
        return ApiError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", "")) or self.limit_for(scope)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.isdigit():
                    bad = ApiError(400, "Invalid Content-Length header.", code="invalid_header")
                    await error_response(bad)(scope, receive, send)
                    return
                if int(value) > limit:
                    await error_response(self._too_large(limit))(scope, receive, send)
                    return
        received = 0

        async def limited() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised inside the endpoint's body read, so the app's error handler answers it.
                    raise self._too_large(limit)
            return message

        await self.app(scope, limited, send)

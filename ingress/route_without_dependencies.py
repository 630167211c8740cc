"""``LeanRoute``: a FastAPI route for endpoints that take the ``Request`` alone and return a ``Response``.

FastAPI's own handler solves dependencies and parameters and serialises return values on every call: about
60 us a request on the 2-core box, and three times that when the request finds the CPU's caches cold, as it
does between requests at 50 a second. The endpoints that publish requests authenticate and parse their
bodies themselves, so they run on this route class and skip that machinery. Their OpenAPI entries come from
the route's ``openapi_extra`` and ``responses`` as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar, cast

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute

E = TypeVar("E", bound=Callable[..., Any])


class LeanRoute(APIRoute):
    """Calls ``endpoint(request)`` and sends the ``Response`` it returns; nothing else per request."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = cast(Callable[[Request], Awaitable[Response]], self.endpoint)

        async def handler(request: Request) -> Response:
            return await endpoint(request)

        return handler


def lean_post(router: APIRouter, path: str, **options: Any) -> Callable[[E], E]:
    """Register the decorated ``endpoint(request) -> Response`` as a POST on ``router``, on ``LeanRoute``;
    ``options`` are :meth:`APIRouter.add_api_route`'s (document the body with ``openapi_extra``)."""

    def register(endpoint: E) -> E:
        router.add_api_route(path, endpoint, methods=["POST"], route_class_override=LeanRoute, **options)
        return endpoint

    return register

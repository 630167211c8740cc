"""The one way ingress's background watchers (the response cache's fills, the canary judge) read a request's
stream: a callable with the signature of the ingress service's ``events``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from schemas import StreamEvent


class Follow(Protocol):
    """The request's stream events from the first until a terminal event (``IngressService.events``)."""

    def __call__(self, request_id: str, tenant: str, *, timeout_s: float) -> AsyncIterator[StreamEvent]: ...

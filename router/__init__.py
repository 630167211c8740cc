"""Routing policy (topic and partition key per request) as a library, plus a stream processor for
Kafka-native producers (:mod:`router.stream`)."""

from .policy import KeyPolicy, LoadPolicy, cap_tier, resolve_tier
from .router import Route, Router, route

__all__ = ["KeyPolicy", "LoadPolicy", "Route", "Router", "cap_tier", "resolve_tier", "route"]

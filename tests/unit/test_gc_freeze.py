"""Freezing a service's startup heap takes what exists from the collector's view and leaves later garbage to it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from sluicegate.gc_freeze import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_startup_objects_are_frozen_and_later_cycles_still_collected(unfrozen: None) -> None:
    before = gc.get_freeze_count()
    startup = [_Node() for _ in range(100)]
    freeze_startup_heap("test")
    assert gc.get_freeze_count() >= before + len(startup)
    later = _Node()
    gone = weakref.ref(later)
    del later
    gc.collect()
    assert gone() is None

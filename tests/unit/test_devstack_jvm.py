"""The local broker's JVM options: C1 only for a fast start unless full JIT is asked for."""

from __future__ import annotations

from cli.backbone.kafka_broker import C1_ONLY, KAFKA_JVM_OPTS, kafka_jvm_opts
from sluicegate.settings import Settings


def test_the_dev_broker_is_c1_only_by_default_and_full_jit_lifts_only_that_cap() -> None:
    assert kafka_jvm_opts(Settings()) == list(KAFKA_JVM_OPTS)
    assert C1_ONLY in KAFKA_JVM_OPTS
    full = kafka_jvm_opts(Settings(kafka_full_jit=True))
    assert C1_ONLY not in full
    assert full == [o for o in KAFKA_JVM_OPTS if o != C1_ONLY]

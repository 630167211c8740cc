"""The whole pipeline (ingress -> Kafka -> router -> worker -> Redis -> result service) against a SASL_SSL broker:
every service reaches Kafka with SCRAM-SHA-512 over TLS from the SLUICEGATE_KAFKA_* variables alone, answers
the official OpenAI client, and writes no password into its log."""

from __future__ import annotations

import pytest
from openai import OpenAI
from secure_kafka import SecureKafka

from .conftest import Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def kafka_bootstrap(secure_kafka: SecureKafka) -> str:
    """This module's pipeline uses the SASL_SSL broker instead of the plaintext one."""
    return secure_kafka.bootstrap


@pytest.fixture(scope="module")
def pipeline_env(secure_kafka: SecureKafka) -> dict[str, str]:
    return secure_kafka.env()


def test_a_completion_and_a_stream_cross_a_sasl_ssl_kafka(pipeline: Pipeline, secure_kafka: SecureKafka) -> None:
    client = OpenAI(base_url=f"{pipeline.ingress_url}/v1", api_key=pipeline.api_key, max_retries=0, timeout=60)
    assert pipeline.model in [m.id for m in client.models.list()]
    out = client.completions.create(
        model=pipeline.model, prompt="Hello there", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=pipeline.model,
        messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    password = secure_kafka.password()
    for name in ("worker-a", "router", "ingress", "result-service"):
        log = pipeline.find(name).log_path.read_text(errors="replace")
        assert password not in log, f"{name} logged the SASL password"

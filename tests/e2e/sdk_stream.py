"""A streamed greedy completion read through the official ``openai`` SDK on its own thread, for the crash tests
that kill a worker while a client is mid-stream: per choice, the text and finish reason it assembled; the usage
chunk; the request id ingress answered with; and any exception, kept for the test to report."""

from __future__ import annotations

import threading
import time
from typing import Any

from openai import OpenAI

from schemas import TokenEvent

from .conftest import Pipeline


class SdkCompletionStream(threading.Thread):
    def __init__(self, pipeline: Pipeline, prompt: str | list[int], max_tokens: int, n: int = 1) -> None:
        super().__init__(daemon=True)
        self.client = OpenAI(base_url=f"{pipeline.ingress_url}/v1", api_key=pipeline.api_key, max_retries=0)
        self.model = pipeline.model
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.n = n
        self.request_id: str | None = None
        self.texts = [""] * n
        self.finish: list[str | None] = [None] * n
        self.usage: Any = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            raw = self.client.completions.with_raw_response.create(
                model=self.model,
                prompt=self.prompt,
                n=self.n,
                max_tokens=self.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
                timeout=120,
            )
            self.request_id = raw.headers["x-request-id"]
            for chunk in raw.parse():
                if chunk.usage is not None:
                    self.usage = chunk.usage
                for choice in chunk.choices:
                    self.texts[choice.index] += choice.text or ""
                    self.finish[choice.index] = choice.finish_reason or self.finish[choice.index]
        except Exception as exc:  # reported by the test
            self.error = repr(exc)

    def start_until(self, pipeline: Pipeline, min_tokens: int, timeout_s: float = 60) -> str:
        """Start streaming; return the request id once the worker has appended ``min_tokens`` tokens to its
        stream (so a fault injected now lands mid-generation)."""
        self.start()
        deadline = time.monotonic() + timeout_s
        while self.request_id is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert self.request_id is not None, self.error
        while time.monotonic() < deadline:
            events = pipeline.stream_events(self.request_id)
            if sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent)) >= min_tokens:
                return self.request_id
            time.sleep(0.005)
        raise AssertionError(f"{self.request_id} did not reach {min_tokens} tokens")

"""``POST /v1/embeddings`` through the whole pipeline (ingress -> Kafka -> a real worker's engine -> Redis ->
ingress) with the official ``openai`` SDK: float and base64 vectors equal to transformers' pooled, L2-normalized
final hidden states; text, lists of text and token ids; ``pooling`` mean as an extra; ``dimensions`` and an input
over the context refused with a 400; ``/v1/embeddings`` lines in the Batch API."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import pytest
import torch
from openai import BadRequestError, OpenAI
from transformers import AutoModel, AutoTokenizer

from .batch_support import TERMINAL, audit, wait_until
from .conftest import Pipeline, Service

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONTEXT = 128


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {"SLUICEGATE_MAX_MODEL_LEN": str(CONTEXT), "SLUICEGATE_DTYPE": "float32"}


@pytest.fixture(scope="module")
def client(pipeline: Pipeline) -> OpenAI:
    return OpenAI(base_url=f"{pipeline.ingress_url}/v1", api_key=pipeline.api_key, max_retries=0, timeout=120)


def _reference(model_dir: Path, ids: list[int], pooling: str = "last") -> torch.Tensor:
    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(dim=0), dim=0)


def _close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, atol=1e-4, rtol=0)


def test_text_and_list_inputs_as_floats_and_base64(client: OpenAI, pipeline: Pipeline, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    texts = ["The river ran quietly", "past the old mill", "and on"]
    out = client.embeddings.create(model=pipeline.model, input=texts, encoding_format="float")
    assert out.object == "list" and out.model == pipeline.model
    assert [d.index for d in out.data] == [0, 1, 2]
    counts = [len(tokenizer.encode(t)) for t in texts]
    assert out.usage.prompt_tokens == sum(counts) == out.usage.total_tokens
    for text, item in zip(texts, out.data, strict=True):
        _close(item.embedding, _reference(tiny_model_dir, tokenizer.encode(text)))
    # The SDK's default asks for base64 and decodes it itself; the raw answer is little-endian float32.
    default = client.embeddings.create(model=pipeline.model, input=texts[0])
    _close(default.data[0].embedding, _reference(tiny_model_dir, tokenizer.encode(texts[0])))
    raw = client.embeddings.with_raw_response.create(model=pipeline.model, input=texts[0], encoding_format="base64")
    encoded = raw.http_response.json()["data"][0]["embedding"]
    assert isinstance(encoded, str)
    decoded = struct.unpack(f"<{len(base64.b64decode(encoded)) // 4}f", base64.b64decode(encoded))
    _close(list(decoded), _reference(tiny_model_dir, tokenizer.encode(texts[0])))


def test_token_id_inputs_and_mean_pooling(client: OpenAI, pipeline: Pipeline, tiny_model_dir: Path) -> None:
    ids = [[5, 17, 90, 33], [7, 8]]
    out = client.embeddings.create(model=pipeline.model, input=ids, encoding_format="float")
    for item, prompt in zip(out.data, ids, strict=True):
        _close(item.embedding, _reference(tiny_model_dir, prompt))
    mean = client.embeddings.create(
        model=pipeline.model, input=ids[0], encoding_format="float", extra_body={"pooling": "mean"}
    )
    assert mean.usage.prompt_tokens == 4
    _close(mean.data[0].embedding, _reference(tiny_model_dir, ids[0], "mean"))


def test_dimensions_and_inputs_over_the_context_are_400s(client: OpenAI, pipeline: Pipeline) -> None:
    with pytest.raises(BadRequestError) as caught:
        client.embeddings.create(model=pipeline.model, input="hello", dimensions=8)
    assert caught.value.code == "unsupported_parameter" and "dimensions" in caught.value.message
    too_long = list(range(3, 3 + CONTEXT + 1))
    with pytest.raises(BadRequestError) as caught:
        client.embeddings.create(model=pipeline.model, input=too_long)
    assert caught.value.code == "context_length_exceeded", caught.value.body
    with pytest.raises(BadRequestError):  # one input too long refuses the call
        client.embeddings.create(model=pipeline.model, input=[[5, 6], too_long])
    # A prompt that fills the context exactly is embedded (nothing is generated after it).
    full = client.embeddings.create(model=pipeline.model, input=too_long[:CONTEXT], encoding_format="float")
    assert full.usage.prompt_tokens == CONTEXT


def test_embeddings_lines_in_a_batch(
    client: OpenAI, pipeline: Pipeline, batch_worker: Service, tiny_model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    def line(custom_id: str, **body: object) -> dict[str, object]:
        body = {"model": pipeline.model, **body}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}

    lines = [
        line("text", input="The river ran quietly"),
        line("ids-b64", input=[5, 17, 90], encoding_format="base64"),
        line("two", input=["a", "b"]),  # one input per line
        line("dims", input="x", dimensions=4),
    ]
    upload = client.files.create(file=("e.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    batch = wait_until(client, batch.id, lambda b: b.status in TERMINAL, timeout_s=180)
    assert batch.status == "completed", batch
    result = audit(client, batch)
    outputs = {o["custom_id"]: o["response"]["body"] for o in result.outputs}
    errors = {e["custom_id"]: e["response"] for e in result.errors}
    assert set(outputs) == {"text", "ids-b64"} and set(errors) == {"two", "dims"}
    assert errors["two"]["status_code"] == 400 and errors["dims"]["body"]["error"]["param"] == "dimensions"
    text = outputs["text"]
    ids = tokenizer.encode("The river ran quietly")
    assert text["object"] == "list" and text["usage"]["prompt_tokens"] == len(ids)
    _close(text["data"][0]["embedding"], _reference(tiny_model_dir, ids))
    raw = base64.b64decode(outputs["ids-b64"]["data"][0]["embedding"])
    _close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), _reference(tiny_model_dir, [5, 17, 90]))

"""A chat request's ``chat_template_kwargs`` reach the model's chat template in the worker and in ingress's own
rendering alike (Qwen3's ``enable_thinking``), and the worker advertises the reasoning parser its template needs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from gpu_workers.engine.models.random_checkpoint import THINKING_CHAT_TEMPLATE, build_tokenizer
from gpu_workers.worker.heartbeat import model_tokenizer
from gpu_workers.worker.prompts import prompt_token_ids, reasoning_parser
from schemas import InferenceRequest, ModelTokenizer
from sluicegate.api.prompt_tokens import ModelTokenizerView
from sluicegate.api.reasoning import prompt_opens_reasoning


def _request(**fields: object) -> InferenceRequest:
    base = {"request_id": "r1", "model": "m", "messages": [{"role": "user", "content": "Why is the sky blue?"}]}
    return InferenceRequest.model_validate(base | fields)


@pytest.fixture(scope="module")
def tokenizer() -> object:
    built = build_tokenizer(512)
    built.chat_template = THINKING_CHAT_TEMPLATE
    return built


@pytest.mark.parametrize(
    ("kwargs", "tail", "opened"),
    [
        (None, "<|im_start|>assistant\n", False),
        ({"enable_thinking": True}, "<|im_start|>assistant\n", False),
        ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ({"open_think": True}, "<|im_start|>assistant\n<think>\n", True),
    ],
)
def test_template_kwargs_render_the_same_prompt_in_the_worker_and_ingress(
    tokenizer: object, kwargs: dict[str, object] | None, tail: str, opened: bool
) -> None:
    request = _request(chat_template_kwargs=kwargs)
    ids = prompt_token_ids(request, tokenizer)
    published = model_tokenizer("m", tokenizer, max_model_len=None)
    assert published is not None
    view = ModelTokenizerView(ModelTokenizer.model_validate_json(published))
    text = view.render_request(request)
    assert text.endswith(tail)
    assert view.encode_request(request) == ids  # ingress counts what the worker runs
    assert tokenizer.decode(ids).endswith(tail)  # type: ignore[attr-defined]
    assert prompt_opens_reasoning(text) is opened


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"messages": []}, "cannot set messages"),
        ({"add_generation_prompt": False}, "cannot set add_generation_prompt"),
        ({"not an identifier": 1}, "pattern"),
        ({f"k{i}": i for i in range(33)}, "at most 32"),
    ],
)
def test_template_kwargs_that_would_replace_the_pipelines_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        _request(chat_template_kwargs=kwargs)
    with pytest.raises(ValidationError, match="need 'messages'"):
        InferenceRequest(request_id="r1", model="m", prompt="hi", chat_template_kwargs={"enable_thinking": False})


@pytest.mark.parametrize(
    ("template", "setting", "parser"),
    [
        (THINKING_CHAT_TEMPLATE, "auto", "qwen3"),
        ("{{ messages }}", "auto", None),
        (None, "auto", None),
        (THINKING_CHAT_TEMPLATE, "none", None),
        ("{{ messages }}", "deepseek_r1", "deepseek_r1"),
    ],
)
def test_the_advertised_reasoning_parser(template: str | None, setting: str, parser: str | None) -> None:
    assert reasoning_parser(SimpleNamespace(chat_template=template), setting) == parser

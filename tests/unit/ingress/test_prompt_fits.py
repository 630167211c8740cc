"""Ingress's exact context check: prompt + ``max_tokens`` within the model's context, as vLLM answers it; an
embedding's refusal speaks of its input alone."""

from __future__ import annotations

import pytest

from sluicegate.api.errors import ApiError
from sluicegate.api.prompt_tokens import check_prompt_fits


def test_a_default_max_tokens_shrinks_to_the_room_left_and_an_explicit_one_is_refused() -> None:
    assert check_prompt_fits(10, 20, 64, explicit=True) == 20
    assert check_prompt_fits(10, 100, 64, explicit=False) == 54
    with pytest.raises(ApiError) as caught:
        check_prompt_fits(10, 100, 64, explicit=True, param="prompt")
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "context_length_exceeded", "prompt")
    assert "110 tokens (10 in the prompt, 100 in the completion)" in caught.value.message
    with pytest.raises(ApiError) as caught:
        check_prompt_fits(10, 100, 64, explicit=True)
    assert "(10 in the messages, 100" in caught.value.message and caught.value.param == "messages"


def test_an_embedding_over_the_context_is_told_about_its_input() -> None:
    with pytest.raises(ApiError) as caught:
        check_prompt_fits(70, 0, 64, explicit=True, param="input")
    assert caught.value.param == "input"
    assert "you requested 70 tokens in the input" in caught.value.message
    assert "completion" not in caught.value.message

"""`sluicegate up --model PATH[=NAME] ...`: the model arguments become one worker spec per public name."""

from __future__ import annotations

import pytest

from sluicegate.stack.cli import build_parser
from sluicegate.stack.launcher import ModelSpec, parse_model_specs


def test_no_model_means_the_demo_model() -> None:
    assert parse_model_specs(None) == [None]


def test_each_model_gets_its_name_or_its_folder_name() -> None:
    args = build_parser().parse_args(["up", "--model", "/m/small=fast", "--model", "/m/big/"])
    assert parse_model_specs(args.model) == [ModelSpec("/m/small", "fast"), ModelSpec("/m/big/", "big")]


def test_model_name_still_names_a_single_model() -> None:
    assert parse_model_specs(["/m/x"], model_name="pub") == [ModelSpec("/m/x", "pub")]


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["/m/a=x", "/m/b=x"], "more than one model"),
        (["/m/a", "/n/a"], "more than one model"),
        (["/m/a="], "PATH=NAME"),
        (["=name"], "PATH=NAME"),
    ],
)
def test_ambiguous_or_empty_specs_are_refused(specs: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_model_specs(specs)


def test_model_name_with_several_models_is_refused() -> None:
    with pytest.raises(ValueError, match="--model-name"):
        parse_model_specs(["/a", "/b"], model_name="x")

"""Each service reads only the settings its own class carries: read the code and check every attribute it takes
off a settings object.

Tests and the command line pass one whole ``Settings`` to every service, so a service reading a field that its
own class lacks would pass them and then fail in production, where the service builds its own class from the
environment. Two checks, by reading the source:

* in each service's package, whatever is read off anything named ``settings`` (``settings.x``,
  ``self.settings.x``, ``ctx.settings.x``...) is an attribute of that service's class;
* anywhere in the product, a parameter annotated with a settings class (``settings: KafkaSettings``), or the
  attribute of ``self`` an ``__init__`` keeps it in, is read only for attributes of that class.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

import sluicegate.settings as settings_package
from sluicegate.settings import (
    BatchServiceSettings,
    IngressSettings,
    ResultServiceSettings,
    RouterSettings,
    SettingsBase,
    WorkerSettings,
)

ROOT = Path(__file__).resolve().parents[2]
SERVICE_PACKAGES: dict[str, type[SettingsBase]] = {
    "ingress": IngressSettings,
    "gpu_workers/worker": WorkerSettings,
    "router": RouterSettings,
    "result_service": ResultServiceSettings,
    "batch_service": BatchServiceSettings,
}
PRODUCT = ("sluicegate", "ingress", "router", "result_service", "gpu_workers/worker", "batch_service", "cli")
SETTINGS_NAMES = ("settings", "_settings")
#: Every settings class by name, as annotations spell them.
CLASSES: dict[str, type[SettingsBase]] = {
    name: value
    for name, value in vars(settings_package).items()
    if isinstance(value, type) and issubclass(value, SettingsBase)
}


def _has(cls: type[SettingsBase], attribute: str) -> bool:
    # A field is no class attribute in pydantic; properties and model methods are.
    return attribute in cls.model_fields or hasattr(cls, attribute)


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _reads_off_settings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) of each ``<...>settings.attribute`` read."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in SETTINGS_NAMES:
                found.append((node.lineno, node.attr))
    return found


def _settings_class(annotation: ast.expr | None) -> type[SettingsBase] | None:
    """The settings class an annotation names (``X``, ``X | None``, ``"X"``), if it names exactly one."""
    if annotation is None:
        return None
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    named = {node.id for node in ast.walk(annotation) if isinstance(node, ast.Name) and node.id in CLASSES}
    return CLASSES[named.pop()] if len(named) == 1 else None


def _reads_of(body: ast.AST, is_holder: Callable[[ast.expr], bool]) -> list[tuple[int, str]]:
    """(line, attribute) of each attribute read off an expression ``is_holder`` accepts."""
    return [
        (node.lineno, node.attr) for node in ast.walk(body) if isinstance(node, ast.Attribute) and is_holder(node.value)
    ]


def _typed_reads(tree: ast.AST) -> list[tuple[int, str, type[SettingsBase]]]:
    """(line, attribute, class) of each read off a parameter annotated with a settings class, or off the
    attribute of ``self`` that a class's ``__init__`` keeps such a parameter in."""
    found: list[tuple[int, str, type[SettingsBase]]] = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
        arguments = function.args
        for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
            cls = _settings_class(argument.annotation)
            if cls is None:
                continue
            name = argument.arg
            found += [
                (line, attr, cls)
                for line, attr in _reads_of(function, lambda n, name=name: isinstance(n, ast.Name) and n.id == name)
            ]
    for klass in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        init = next((n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:
            continue
        typed = {a.arg: c for a in init.args.args + init.args.kwonlyargs if (c := _settings_class(a.annotation))}
        kept = {
            target.attr: typed[node.value.id]
            for node in ast.walk(init)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in typed
            for target in node.targets
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
        }
        for attribute, cls in kept.items():

            def held(node: ast.expr, attribute: str = attribute) -> bool:
                return (
                    isinstance(node, ast.Attribute)
                    and node.attr == attribute
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                )

            found += [(line, attr, cls) for line, attr in _reads_of(klass, held)]
    return found


@pytest.mark.parametrize("package", list(SERVICE_PACKAGES))
def test_a_service_reads_only_what_its_own_class_carries(package: str) -> None:
    cls = SERVICE_PACKAGES[package]
    stray = [
        f"{path.relative_to(ROOT)}:{line}: {attribute}"
        for path in _sources(package)
        for line, attribute in _reads_off_settings(ast.parse(path.read_text()))
        if not _has(cls, attribute)
    ]
    assert not stray, f"{cls.__name__} has no such field: {stray}"


def test_code_reads_only_what_the_annotated_settings_class_carries() -> None:
    stray = [
        f"{path.relative_to(ROOT)}:{line}: {cls.__name__}.{attribute}"
        for folder in PRODUCT
        for path in _sources(folder)
        if not path.is_relative_to(ROOT / "sluicegate" / "settings")
        for line, attribute, cls in _typed_reads(ast.parse(path.read_text()))
        if not _has(cls, attribute)
    ]
    assert not stray


def test_the_checks_see_a_stray_read() -> None:
    # The checks themselves: an ingress function reading an engine field is caught by both.
    source = "def f(settings: IngressSettings) -> int:\n    return settings.max_num_seqs\n"
    tree = ast.parse(source)
    assert [a for _, a in _reads_off_settings(tree) if not _has(IngressSettings, a)] == ["max_num_seqs"]
    assert [(a, c) for _, a, c in _typed_reads(tree) if not _has(c, a)] == [("max_num_seqs", IngressSettings)]

"""The arrows between packages run one way (docs/architecture.md): read every module's imports and check them.

* ``schemas`` imports no other package of the project;
* the runtime library (``sluicegate`` outside ``sluicegate.stack``) imports only ``schemas``;
* ``gpu_workers.engine`` imports nothing of the pipeline: no project package outside itself, no Kafka, Redis
  or pydantic (it must run on a bare GPU image);
* services import no other service, except ``ingress`` -> ``router`` and ``batch_service`` -> ``router`` (the
  routing library, used in-process to publish); the worker may use the engine; in particular ``ingress`` and
  ``batch_service`` never import each other: what both use lives in the runtime library (``sluicegate.api``,
  ``sluicegate.batches``);
* nothing imports the composition root ``sluicegate.stack`` (``python -m sluicegate``, ``sluicegate.__main__``, is
  part of that root).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = (
    "schemas",
    "sluicegate",
    "ingress",
    "batch_service",
    "router",
    "gpu_workers",
    "result_service",
    "benchmarks",
)
#: What wires the services together: the stack, and ``python -m sluicegate`` which starts its command line.
COMPOSITION_ROOT = ("sluicegate.stack", "sluicegate.__main__")
PIPELINE_LIBRARIES = ("aiokafka", "redis", "pydantic", "pydantic_settings", "fastapi", "celery")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str | None = None) -> set[str]:
    """Absolute names of everything ``path`` imports (relative imports resolved against its package)."""
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.add(name)
    return found


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _offending(package: str, allowed: tuple[str, ...], *, skip: tuple[str, ...] = ()) -> list[str]:
    """``module -> import`` for each project import of ``package`` outside itself and ``allowed``."""
    bad = []
    for path in _modules(package):
        module = _module_name(path)
        if any(_within(module, s) for s in skip):
            continue
        for name in _imports(path):
            top = name.split(".")[0]
            if top not in PROJECT or _within(name, package) or any(_within(name, a) for a in allowed):
                continue
            bad.append(f"{module} -> {name}")
    return bad


def test_schemas_import_no_other_package() -> None:
    assert _offending("schemas", ()) == []


def test_the_runtime_library_imports_only_schemas() -> None:
    bad = _offending("sluicegate", ("schemas",), skip=COMPOSITION_ROOT)
    bad += [
        f"{_module_name(p)} -> {n}"
        for p in _modules("sluicegate")
        if not any(_within(_module_name(p), root) for root in COMPOSITION_ROOT)
        for n in _imports(p)
        if _within(n, "sluicegate.stack")
    ]
    assert bad == []


def test_the_engine_imports_nothing_of_the_pipeline() -> None:
    assert _offending("gpu_workers.engine", ()) == []
    libraries = [
        f"{_module_name(p)} -> {n}"
        for p in _modules("gpu_workers.engine")
        for n in _imports(p)
        if n.split(".")[0] in PIPELINE_LIBRARIES
    ]
    assert libraries == []


@pytest.mark.parametrize(
    ("service", "allowed"),
    [
        ("ingress", ("schemas", "sluicegate", "router")),
        ("batch_service", ("schemas", "sluicegate", "router")),
        ("router", ("schemas", "sluicegate")),
        ("gpu_workers.worker", ("schemas", "sluicegate", "gpu_workers.engine")),
        ("result_service", ("schemas", "sluicegate")),
    ],
)
def test_services_import_only_downwards(service: str, allowed: tuple[str, ...]) -> None:
    bad = _offending(service, allowed)
    bad += [
        f"{_module_name(p)} -> {n}" for p in _modules(service) for n in _imports(p) if _within(n, "sluicegate.stack")
    ]
    assert bad == []


@pytest.mark.parametrize(("service", "other"), [("ingress", "batch_service"), ("batch_service", "ingress")])
def test_ingress_and_the_batch_service_import_neither_way(service: str, other: str) -> None:
    """The two processes share code only through the runtime library, never each other's modules."""
    assert _modules(service), f"no modules under {service}"
    assert [f"{_module_name(p)} -> {n}" for p in _modules(service) for n in _imports(p) if _within(n, other)] == []


def test_the_reader_resolves_relative_imports(tmp_path: Path) -> None:
    """A back arrow written as ``from .stack import cli`` or ``from ..ingress import app`` is seen too."""
    probe = tmp_path / "probe.py"
    probe.write_text("from .stack import cli\nfrom ..ingress import app\nimport router.policy\n")
    assert _imports(probe, "sluicegate.sub.probe") == {"sluicegate.sub.stack", "sluicegate.ingress", "router.policy"}

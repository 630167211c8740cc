"""The arrows between packages run one way (docs/architecture.md): read every module's imports and check them.

* ``schemas`` imports no other package of the project;
* the runtime library (``sluicegate`` outside ``sluicegate.stack``) imports only ``schemas``;
* ``gpu_workers.engine`` imports nothing of the pipeline: no project package outside itself, no Kafka, Redis
  or pydantic (it must run on a bare GPU image);
* inside the engine, ``core`` holds the leaf types (sequence, scheduler, KV block manager, request) that the driver
  ``llm_engine`` steps and ``execution``, ``spec_decode``, ``distributed`` and ``entrypoints`` read: it imports
  none of them;
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
#: What stands above the engine's leaf types in ``gpu_workers.engine.core``: the driver that steps them, and the
#: packages that run their sequences (``execution``, ``spec_decode``, ``distributed``) or front the driver.
ABOVE_ENGINE_CORE = (
    "gpu_workers.engine.llm_engine",
    "gpu_workers.engine.execution",
    "gpu_workers.engine.spec_decode",
    "gpu_workers.engine.distributed",
    "gpu_workers.engine.entrypoints",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str | None = None, *, with_names: bool = False) -> set[str]:
    """Absolute names of everything ``path`` imports (relative imports resolved against its package).

    ``with_names``: also ``package.name`` for each ``from package import name``, since the name may be a module
    (``from .. import llm_engine``)."""
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
            if with_names:
                found.update(f"{name}.{alias.name}" for alias in node.names if alias.name != "*")
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


def test_the_engine_core_imports_nothing_that_stands_above_it() -> None:
    """``core`` is the engine's ground floor: the driver and the execution, speculative-decoding, tensor-parallel
    and front-end packages import its types, so an import the other way would close a circle."""
    core = _modules("gpu_workers.engine.core")
    assert core, "no modules under gpu_workers.engine.core"
    for above in ABOVE_ENGINE_CORE:
        where = ROOT / above.replace(".", "/")
        assert where.is_dir() or where.with_suffix(".py").is_file(), f"{above} is gone: name what replaced it"
    bad = [
        f"{_module_name(p)} -> {n}"
        for p in core
        for n in _imports(p, with_names=True)
        if any(_within(n, above) for above in ABOVE_ENGINE_CORE)
    ]
    assert bad == []


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


def test_the_reader_sees_a_module_imported_by_name(tmp_path: Path) -> None:
    """``from .. import llm_engine`` names the module only as an imported name; ``with_names`` sees it."""
    probe = tmp_path / "probe.py"
    probe.write_text("from .. import llm_engine\nfrom .scheduler import Scheduler\n")
    found = _imports(probe, "gpu_workers.engine.core.probe", with_names=True)
    assert {"gpu_workers.engine.llm_engine", "gpu_workers.engine.core.scheduler"} <= found
    assert "gpu_workers.engine.llm_engine" not in _imports(probe, "gpu_workers.engine.core.probe")

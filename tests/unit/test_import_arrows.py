"""The arrows between packages run one way (docs/architecture.md): read every module's imports and check them.

* ``schemas`` imports no other package of the project;
* the runtime library ``sluicegate`` imports only ``schemas``;
* ``gpu_workers.engine`` imports nothing of the pipeline: no project package outside itself, no Kafka, Redis
  or pydantic (it must run on a bare GPU image), but the KV block hash chain ``sluicegate.block_hashes`` (a module
  of the standard library alone, under a package whose ``__init__`` imports nothing), which the router hashes
  prompts with;
* inside the engine, ``core`` holds the leaf types (sequence, scheduler, KV block manager, request) that the driver
  ``llm_engine`` steps and ``execution``, ``spec_decode``, ``distributed`` and ``entrypoints`` read: it imports
  none of them;
* services import no other service, except ``ingress`` -> ``router`` and ``batch_service`` -> ``router`` (the
  routing library, used in-process to publish); the worker may use the engine; in particular ``ingress`` and
  ``batch_service`` never import each other: what both use lives in the runtime library (``sluicegate.api``,
  ``sluicegate.batches``);
* nothing imports the composition root ``cli`` (the command line, ``up``, the local backbone, the client tools) but
  the benchmarks, which stand beside it on top;
* no import cycle among the product's modules: arrows between files run one way too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = (
    "schemas",
    "sluicegate",
    "cli",
    "ingress",
    "batch_service",
    "router",
    "gpu_workers",
    "result_service",
    "benchmarks",
)
#: What wires the services together: the command line, ``up`` and the local backbone.
COMPOSITION_ROOT = "cli"
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


def _source(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` reads from, a relative one resolved against ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join([*base, node.module] if node.module else base)


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
            name = _source(node, package)
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
    assert _offending("sluicegate", ("schemas",)) == []


#: What the engine may import from outside itself: pure modules that the pipeline shares with it.
ENGINE_SHARED = ("sluicegate.block_hashes",)


def test_the_engine_imports_nothing_of_the_pipeline() -> None:
    assert _offending("gpu_workers.engine", ENGINE_SHARED) == []
    libraries = [
        f"{_module_name(p)} -> {n}"
        for p in _modules("gpu_workers.engine")
        for n in _imports(p)
        if n.split(".")[0] in PIPELINE_LIBRARIES
    ]
    assert libraries == []


def test_what_the_engine_shares_imports_the_standard_library_only() -> None:
    """Importing ``sluicegate.block_hashes`` runs ``sluicegate/__init__.py`` too: both must stay free of the
    pipeline's libraries (and of the project), or the engine's bare GPU image would need them."""
    import sys

    for shared in ENGINE_SHARED:
        package = shared.rpartition(".")[0]
        for path in (ROOT / package.replace(".", "/") / "__init__.py", ROOT / (shared.replace(".", "/") + ".py")):
            tops = {n.split(".")[0] for n in _imports(path)} - {"__future__"}
            assert tops <= set(sys.stdlib_module_names), f"{path} imports {tops - set(sys.stdlib_module_names)}"


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
    assert _offending(service, allowed) == []


def test_nothing_but_the_benchmarks_imports_the_composition_root() -> None:
    bad = [
        f"{_module_name(p)} -> {n}"
        for package in PROJECT
        if package not in (COMPOSITION_ROOT, "benchmarks")
        for p in _modules(package)
        for n in _imports(p)
        if _within(n, COMPOSITION_ROOT)
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


# --- cycles between files ---------------------------------------------------------------------------------------


def _file_of(name: str) -> Path | None:
    """The project file that an imported name is: a module, or a package's ``__init__.py``."""
    base = ROOT / name.replace(".", "/")
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _file_arrows(path: Path) -> set[Path]:
    """The project files ``path`` imports, lazy imports included: ``from pkg import mod`` is an arrow to
    ``pkg/mod.py`` when that is a module, else to ``pkg/__init__.py``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _source(node, package)
            names = [f"{source}.{alias.name}" if _file_of(f"{source}.{alias.name}") else source for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PROJECT and (target := _file_of(name)) is not None and target != path:
                targets.add(target)
    return targets


def _cycles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in arrows:
        if root in index:
            continue
        work = [(root, iter(sorted(arrows[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(arrows.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycle_among_the_product_s_files() -> None:
    """Two files that import each other (even lazily) have one job between them, or a shared type that wants a
    module of its own."""

    def name(path: Path) -> str:
        return str(path.relative_to(ROOT))

    arrows = {name(path): {name(t) for t in _file_arrows(path)} for package in PROJECT for path in _modules(package)}
    assert _cycles(arrows) == []


def test_the_cycle_finder_sees_loops_and_only_loops() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert sorted(_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}})) == [["a", "b"], ["c", "d"]]


def test_the_file_reader_sees_a_lazy_import_of_a_submodule() -> None:
    """``from cli.bench import measure`` inside a function is an arrow to ``cli/bench/measure.py``."""
    assert ROOT / "cli" / "bench" / "measure.py" in _file_arrows(ROOT / "cli" / "bench" / "batch.py")

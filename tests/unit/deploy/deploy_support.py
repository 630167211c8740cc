"""Helpers of the deployment tests: a pinned helm binary, chart rendering, manifest validation, and CLI parsing.

helm is built from source with ``go install helm.sh/helm/v3/cmd/helm@<infra/helm/HELM_VERSION>`` into
the repository's state folder (``.sluicegate/bin``) the first time it is needed; ``infra/local/run.sh``
does the same before the suite runs. Without a Go toolchain the helm tests skip, saying so (under ``CI`` they
fail: ``tests/needs.py``).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from crd_schemas import CUSTOM_SCHEMAS
from needs import require

REPO_ROOT = Path(__file__).resolve().parents[3]
CHART = REPO_ROOT / "infra" / "helm" / "sluicegate"
HELM_VERSION = (REPO_ROOT / "infra" / "helm" / "HELM_VERSION").read_text().strip()
HELM_BIN_DIR = REPO_ROOT / ".sluicegate" / "bin"
TWO_GPU_VALUES = Path(__file__).resolve().parent / "values-two-gpu-models.yaml"
SECURE_VALUES = Path(__file__).resolve().parent / "values-secure-transport.yaml"
# The Kubernetes version the chart is rendered and validated for (the chart's kubeVersion is >=1.27).
KUBE_VERSION = "1.31.0"


def _go() -> str | None:
    found = shutil.which("go")
    if found:
        return found
    default = Path("/usr/local/go/bin/go")  # the official tarball's place, often not on PATH
    return str(default) if default.exists() else None


def _built_version(go: str, binary: Path) -> str | None:
    """The helm module version a binary was built from (``go version -m``), or None."""
    out = subprocess.run([go, "version", "-m", str(binary)], capture_output=True, text=True, check=False).stdout
    match = re.search(r"^\s*mod\s+helm\.sh/helm/v3\s+(\S+)", out, re.MULTILINE)
    return match.group(1) if match else None


@pytest.fixture(scope="session")
def helm() -> Path:
    """The pinned helm, built once with the Go toolchain."""
    binary = HELM_BIN_DIR / "helm"
    go = _go()
    if go is None:
        if binary.exists():
            return binary  # built earlier; without Go its version cannot be read, and it was pinned then
        require(False, f"helm {HELM_VERSION}", "the Go toolchain is absent, so it cannot be built (go install)")
    if binary.exists() and _built_version(go, binary) == HELM_VERSION:
        return binary
    HELM_BIN_DIR.mkdir(parents=True, exist_ok=True)
    # Each pytest-xdist worker has its own session: one builds while the others wait for it and then use its
    # binary, instead of two `go install`s writing one file (a half-written helm, or "text file busy").
    with (HELM_BIN_DIR / ".helm-build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.exists() and _built_version(go, binary) == HELM_VERSION:
            return binary
        env = {**os.environ, "GOBIN": str(HELM_BIN_DIR), "GOFLAGS": "-buildvcs=false"}
        result = subprocess.run(
            [go, "install", f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
    assert result.returncode == 0, f"go install helm {HELM_VERSION} failed:\n{result.stderr[-4000:]}"
    assert _built_version(go, binary) == HELM_VERSION
    return binary


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # A private HOME-like folder so a developer's helm repositories and plugins play no part.
    env = {
        **os.environ,
        "HELM_CACHE_HOME": "/tmp/sluicegate-helm/cache",
        "HELM_CONFIG_HOME": "/tmp/sluicegate-helm/cfg",
    }
    return subprocess.run([str(helm), *args], capture_output=True, text=True, env=env, timeout=120, check=False)


Manifests = list[dict[str, Any]]


@pytest.fixture(scope="session")
def render(helm: Path) -> Callable[..., Manifests]:
    """``render(values_file, *extra)`` -> the manifests ``helm template`` prints (fails on an error)."""

    def _render(values: Path | None = None, *extra: str) -> Manifests:
        args = ["template", "sg", str(CHART), "--namespace", "llm", "--kube-version", KUBE_VERSION]
        if values is not None:
            args += ["-f", str(values)]
        result = run_helm(helm, *args, *extra)
        assert result.returncode == 0, result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    return _render


def template_error(helm: Path, values_text: str, tmp_path: Path) -> str:
    """The error ``helm template`` gives for these values (asserts that it fails)."""
    path = tmp_path / "values.yaml"
    path.write_text(values_text)
    result = run_helm(helm, "template", "sg", str(CHART), "--kube-version", KUBE_VERSION, "-f", str(path))
    assert result.returncode != 0, "helm template accepted values it should refuse"
    return result.stderr


def write_values(tmp_path: Path, values: dict[str, Any]) -> Path:
    """Values as a file for ``render``."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def by_kind(manifests: Manifests, kind: str) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def pod_specs(manifests: Manifests) -> dict[str, dict[str, Any]]:
    """Each Deployment's pod spec, by the Deployment's name."""
    return {m["metadata"]["name"]: m["spec"]["template"]["spec"] for m in manifests if m["kind"] == "Deployment"}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """A container's variables: the value, or the ``valueFrom`` source."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def validate_manifest(manifest: dict[str, Any]) -> None:
    """Strict validation: core kinds with kubernetes-validate, the CRDs with crd_schemas.py (raises on an error)."""
    key = (manifest["apiVersion"], manifest["kind"])
    if key in CUSTOM_SCHEMAS:
        jsonschema.validate(manifest, CUSTOM_SCHEMAS[key])
        behavior = manifest["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
        if behavior is not None:  # KEDA copies it into the HPA it creates: hold it to the HPA's schema
            hpa = {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": "keda-hpa"},
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                    "maxReplicas": 1,
                    "behavior": behavior,
                },
            }
            kubernetes_validate.validate(hpa, KUBE_VERSION, strict=True)
        return
    kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)


def parse_cli(args: list[str]) -> Any:
    """Parse ``sluicegate <args>`` with the real CLI parser; an unknown command fails the test."""
    from cli.main import build_parser

    try:
        return build_parser().parse_args(args)
    except SystemExit as exc:  # argparse exits on an error after printing it
        raise AssertionError(f"`sluicegate {' '.join(args)}` is not a valid command line") from exc

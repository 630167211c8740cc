"""The Dockerfiles, read with dockerfile-parse (no Docker engine is needed): pinned bases, a non-root
user, the one `sluicegate` entrypoint, and COPY sources that exist and are not ignored."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from typing import Any

import pytest
from deploy_support import REPO_ROOT, parse_cli
from dockerfile_parse import DockerfileParser

DOCKER_DIR = REPO_ROOT / "infra" / "docker"
IMAGES = ["services", "worker"]


def _instructions(image: str) -> list[dict[str, Any]]:
    parser = DockerfileParser(path=str(DOCKER_DIR / f"{image}.Dockerfile"))
    return parser.structure


def _final_stage(image: str) -> list[dict[str, Any]]:
    instructions = _instructions(image)
    last_from = max(i for i, ins in enumerate(instructions) if ins["instruction"] == "FROM")
    return instructions[last_from:]


def _build_args(image: str) -> dict[str, str]:
    """ARG defaults of a Dockerfile."""
    values = [ins["value"] for ins in _instructions(image) if ins["instruction"] == "ARG"]
    return dict(value.split("=", 1) for value in values if "=" in value)


def _ignored(image: str) -> list[str]:
    text = (DOCKER_DIR / f"{image}.Dockerfile.dockerignore").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("image", IMAGES)
def test_base_images_are_pinned_to_a_patch_release(image: str) -> None:
    bases = [ins["value"].split()[0] for ins in _instructions(image) if ins["instruction"] == "FROM"]
    assert bases
    for base in bases:
        _, _, tag = base.partition(":")
        assert "$" not in base and tag and tag != "latest", f"{base} is not pinned"
        assert re.match(r"^\d+\.\d+\.\d+-", tag), f"{base}: pin a full version, not a moving tag"


@pytest.mark.parametrize("image", IMAGES)
def test_final_stage_runs_as_a_numeric_non_root_user(image: str) -> None:
    users = [ins["value"] for ins in _final_stage(image) if ins["instruction"] == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric uid lets Kubernetes' runAsNonRoot verify it"


@pytest.mark.parametrize("image", IMAGES)
def test_the_entrypoint_is_sluicegate_and_the_default_command_is_real(image: str) -> None:
    final = _final_stage(image)
    (entrypoint,) = [json.loads(ins["value"]) for ins in final if ins["instruction"] == "ENTRYPOINT"]
    assert entrypoint == ["sluicegate"]
    (cmd,) = [json.loads(ins["value"]) for ins in final if ins["instruction"] == "CMD"]
    if cmd != ["--help"]:
        parse_cli(cmd)


def _copies(image: str) -> list[list[str]]:
    """Sources of each COPY from the build context (not --from another stage)."""
    sources = []
    for ins in _instructions(image):
        if ins["instruction"] != "COPY":
            continue
        words = ins["value"].split()
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        sources.append(words[:-1])
    return sources


@pytest.mark.parametrize("image", IMAGES)
def test_every_copy_source_exists_and_is_sent_to_the_builder(image: str) -> None:
    ignored = _ignored(image)
    for source in (s for copy in _copies(image) for s in copy):
        assert (REPO_ROOT / source).exists(), f"COPY {source}: no such file in the repository"
        top = source.strip("/").split("/")[0]
        assert not any(fnmatch.fnmatch(top, pattern) for pattern in ignored), f"COPY {source} is in the .dockerignore"


@pytest.mark.parametrize("image", IMAGES)
def test_every_python_package_of_the_project_is_copied(image: str) -> None:
    """A new top-level package in pyproject.toml must reach the image too."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {s.strip("/") for copy in _copies(image) for s in copy}
    assert packages <= copied, f"not copied into the image: {packages - copied}"
    assert {"pyproject.toml", "README.md"} <= copied  # pip install . reads both


def test_services_image_takes_torch_from_the_cpu_index() -> None:
    instructions = _instructions("services")
    assert _build_args("services")["TORCH_INDEX_URL"].endswith("/whl/cpu")
    runs = [ins["value"] for ins in instructions if ins["instruction"] == "RUN"]
    torch_run = next(r for r in runs if "torch" in r)
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_run
    assert runs.index(torch_run) < next(i for i, r in enumerate(runs) if r.startswith("pip install ."))


def test_worker_image_builds_on_cuda_with_optional_kernels() -> None:
    instructions = _instructions("worker")
    bases = [ins["value"].split()[0] for ins in instructions if ins["instruction"] == "FROM"]
    assert all(b.startswith("nvidia/cuda:") for b in bases)
    args = _build_args("worker")
    assert args["WITH_FLASH_ATTN"] == "0" and args["WITH_BITSANDBYTES"] == "0"
    runs = " ".join(ins["value"] for ins in instructions if ins["instruction"] == "RUN")
    assert "flash-attn==${FLASH_ATTN_VERSION}" in runs and "bitsandbytes" in runs

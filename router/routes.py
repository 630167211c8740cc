"""Model routes as data: the routing file (YAML) that maps a public model name to model versions, validated by
pydantic, and reading it.

A route splits its traffic between versions by weight (an A/B test, or a canary at a small weight), keeps a
tenant or a ``user`` on one version (sticky), may roll a canary back automatically, and may send short prompts
to a smaller model (the fast path). A version is the name a worker group serves; a request naming a version
directly pins it and is not routed. Example::

    routes:
      chat:
        sticky: user              # tenant (default), user (the body's `user`, else the tenant) or none
        targets:
          - {model: llama-8b-v1, weight: 90}
          - {model: llama-8b-v2, weight: 10, canary: true}
        canary:                   # roll the canary back to weight 0 when, over the window, it is worse
          window_s: 60
          min_requests: 20
          error_rate_margin: 0.05 # canary error rate > stable's + 0.05
          ttft_p99_margin: 0.5    # or canary TTFT p99 > stable's x 1.5
        fast_path:
          model: llama-1b
          max_prompt_tokens: 64   # prompts under this many tokens, counted with the fast model's tokenizer
          tokenizer: /models/llama-1b

``sluicegate routes check FILE`` runs the same validation (tokenizers included) without serving anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sluicegate.validation_errors import summarize

_NAME = r"^[A-Za-z0-9._:/@-]{1,256}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Target(_Strict):
    """One version of a route and its share of the traffic (weights are relative)."""

    model: str = Field(pattern=_NAME)
    weight: float = Field(ge=0)
    canary: bool = False


class CanaryPolicy(_Strict):
    """When a canary counts as worse than the stable versions, judged over a sliding window of outcomes."""

    window_s: float = Field(60.0, gt=0)
    min_requests: int = Field(20, ge=1, description="Outcomes the canary needs in the window before a verdict.")
    error_rate_margin: float = Field(0.05, ge=0, le=1)
    ttft_p99_margin: float = Field(0.5, ge=0, description="Relative: 0.5 allows a p99 TTFT 1.5x the stable one.")
    first_token_timeout_s: float = Field(
        30.0, gt=0, description="A request with no first token by then counts as failed (a version that hangs)."
    )


class FastPath(_Strict):
    """Prompts shorter than ``max_prompt_tokens`` (counted with ``tokenizer``) go to ``model``."""

    model: str = Field(pattern=_NAME)
    max_prompt_tokens: int = Field(ge=1)
    tokenizer: Path = Field(description="The fast model's folder (or any folder) holding its tokenizer.json.")


class RouteSpec(_Strict):
    """What one public model name stands for."""

    targets: list[Target] = Field(min_length=1)
    sticky: Literal["tenant", "user", "none"] = "tenant"
    canary: CanaryPolicy | None = None
    fast_path: FastPath | None = None

    @model_validator(mode="after")
    def _consistent(self) -> RouteSpec:
        names = [t.model for t in self.targets]
        if len(set(names)) != len(names):
            raise ValueError(
                f"a version is listed twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}"
            )
        if sum(t.weight for t in self.targets) <= 0:
            raise ValueError("the targets' weights add up to 0: no version would get any traffic")
        canaries = [t for t in self.targets if t.canary]
        if canaries and all(t.canary for t in self.targets):
            raise ValueError("every target is a canary: a canary needs a stable version to compare with")
        if self.canary is not None and not canaries:
            raise ValueError("'canary' settings need a target marked canary: true")
        return self

    @property
    def versions(self) -> list[str]:
        return [t.model for t in self.targets]


class RoutesFile(_Strict):
    """The whole routing file: public model name -> route."""

    routes: dict[str, RouteSpec] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _no_nesting(self) -> RoutesFile:
        for name, spec in self.routes.items():
            inner = [
                v for v in [*spec.versions, *([spec.fast_path.model] if spec.fast_path else [])] if v in self.routes
            ]
            if inner:
                raise ValueError(f"route {name!r}: {', '.join(inner)} is itself a route (routes do not nest)")
        return self


class RoutesError(ValueError):
    """A routing file that cannot be used, with a sentence saying where and why."""


def parse_routes(text: str, *, source: str = "routes file") -> RoutesFile:
    """Validate YAML text as a routing file; ``RoutesError`` naming the field otherwise."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RoutesError(f"{source}: not valid YAML ({exc})") from None
    try:
        return RoutesFile.model_validate(data if data is not None else {})
    except ValidationError as exc:
        raise RoutesError(f"{source}: {summarize(exc)[1]}") from None


def load_routes(path: Path) -> RoutesFile:
    """Read and validate the routing file at ``path`` (blocking: call it off the event loop)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise RoutesError(f"routes file {path}: {exc.strerror or exc}") from None
    return parse_routes(text, source=str(path))

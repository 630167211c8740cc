"""The fast path's token counting, shared by ingress and the router: each route's fast-path tokenizer
(``tokenizer.json`` through the ``tokenizers`` library, which Hugging Face's fast tokenizers are built on,
without loading ``transformers``) and the count of one prompt against the route's bound.

A chat request counts its messages' text, not the chat template's few framing tokens; token-id prompts count
their ids. A prompt longer than ``MAX_CHARS_PER_TOKEN`` characters per allowed token is not short, and is not
tokenized at all (so a huge prompt costs nothing here).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from schemas import InferenceRequest

from .routes import RoutesError, RoutesFile

# No tokenizer in use averages more characters than this per token; a longer prompt is long without counting.
MAX_CHARS_PER_TOKEN = 32


def load_tokenizers(routes: RoutesFile, *, source: Path) -> dict[str, Tokenizer]:
    """Route name -> its fast path's tokenizer (blocking); ``RoutesError`` naming the route for a bad one."""
    tokenizers: dict[str, Tokenizer] = {}
    for name, spec in routes.routes.items():
        if spec.fast_path is None:
            continue
        file = spec.fast_path.tokenizer / "tokenizer.json"
        try:
            tokenizers[name] = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own Exception type for a missing or bad file
            raise RoutesError(f"{source}: route {name!r}: fast_path.tokenizer: cannot load {file}: {exc}") from None
    return tokenizers


def count_tokens(tokenizer: Tokenizer, prompt: str | list[int], limit: int) -> int:
    """The prompt's token count, or ``limit`` for a text too long to be under it (not tokenized)."""
    if not isinstance(prompt, str):
        return len(prompt)
    if len(prompt) > MAX_CHARS_PER_TOKEN * limit:
        return limit
    return len(tokenizer.encode(prompt).ids)


def request_prompt(request: InferenceRequest) -> str | list[int]:
    """What the fast path counts of a pipeline request: its prompt (text or ids), or its messages' text joined
    (as ingress counts the same call's body)."""
    if request.prompt is not None:
        return request.prompt
    return "\n".join(m.text() for m in request.messages or ())

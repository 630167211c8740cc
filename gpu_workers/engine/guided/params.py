"""What a request asks the grammar to enforce: ``GuidedDecoding`` (exactly one kind of constraint)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class GuidedDecoding:
    """Constrain a request's output: exactly one of ``json_schema`` (a dict or its JSON text),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF,
    in the grammar library's GBNF dialect).

    ``replay_token_ids`` are tokens already delivered before a crash; the matcher consumes them before
    generating, so a resumed request (prompt + delivered tokens as its prompt) continues a valid output.
    """

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    replay_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json_schema", self.json_schema),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "guided decoding needs exactly one of json_schema, json_object, regex, choice, grammar; "
                f"got {given or 'none'}"
            )
        if self.json_schema is not None:
            if isinstance(self.json_schema, str):
                try:
                    parsed = json.loads(self.json_schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"json_schema is not valid JSON: {exc}") from None
                if not isinstance(parsed, dict):
                    raise ValueError("json_schema must be a JSON object")
            elif not isinstance(self.json_schema, dict):
                raise ValueError(f"json_schema must be a dict or its JSON text, got {type(self.json_schema).__name__}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"grammar must be a non-empty EBNF string, got {self.grammar!r}")
        if not isinstance(self.replay_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.replay_token_ids
        ):
            raise ValueError(f"replay_token_ids must be a list of token ids, got {self.replay_token_ids!r}")
        self.replay_token_ids = list(self.replay_token_ids)

    @property
    def cache_key(self) -> tuple[str, str]:
        """(kind, canonical text): what a compiled grammar is cached under, with the tokenizer."""
        if self.json_schema is not None:
            schema = json.loads(self.json_schema) if isinstance(self.json_schema, str) else self.json_schema
            return ("json_schema", json.dumps(schema, sort_keys=True))
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(list(self.choice)))
        return ("grammar", self.grammar or "")

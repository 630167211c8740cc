"""Structured output on the real default model: 20 prompts asking for a city, answered under a JSON schema
(``{"city": string}``) by a running Sluicegate (``sluicegate up``), through the official ``openai`` SDK.

Prints per prompt the city the model named, whether it is a real city and whether it is the expected one, then
the totals; exits 1 unless most answers (more than half) name a real city. ``tests/e2e/test_real_model.py`` runs
the first few of the same prompts in CI.

    python -m benchmarks.smollm2_quality --base-url http://127.0.0.1:8000/v1 --api-key <key printed by up>
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MODEL = "smollm2-135m-instruct"

# (prompt, the city a right answer names)
CAPITAL_PROMPTS: list[tuple[str, str]] = [
    (f"Which city is the capital of {country}?", city)
    for country, city in [
        ("France", "Paris"),
        ("Italy", "Rome"),
        ("Japan", "Tokyo"),
        ("Germany", "Berlin"),
        ("Spain", "Madrid"),
        ("the United Kingdom", "London"),
        ("Russia", "Moscow"),
        ("China", "Beijing"),
        ("Egypt", "Cairo"),
        ("Greece", "Athens"),
        ("Portugal", "Lisbon"),
        ("Austria", "Vienna"),
        ("Ireland", "Dublin"),
        ("Norway", "Oslo"),
        ("Sweden", "Stockholm"),
        ("Canada", "Ottawa"),
        ("Australia", "Canberra"),
        ("Argentina", "Buenos Aires"),
        ("Kenya", "Nairobi"),
        ("Thailand", "Bangkok"),
    ]
]

CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}

# Real cities a small model may name for these prompts: the expected capitals and other large cities of the same
# countries (a wrong but real city still shows the structured output carries a meaningful answer).
CITIES: frozenset[str] = frozenset(
    city.lower()
    for city in [
        *(c for _, c in CAPITAL_PROMPTS),
        *"Marseille Lyon Nice Milan Naples Venice Florence Turin Osaka Kyoto Yokohama Munich Hamburg Frankfurt".split(),
        *"Cologne Barcelona Valencia Seville Manchester Birmingham Liverpool Edinburgh Glasgow".split(),
        *"Shanghai Beijing Guangzhou Shenzhen Alexandria Giza Thessaloniki Porto Salzburg Cork".split(),
        *"Bergen Gothenburg Toronto Montreal Vancouver Sydney Melbourne Brisbane Perth Mombasa Phuket".split(),
        "Saint Petersburg",
        "New York",
        "Washington",
        "Brussels",
        "Amsterdam",
        "Copenhagen",
        "Helsinki",
        "Warsaw",
        "Prague",
        "Budapest",
        "Bern",
        "Zurich",
        "Geneva",
        "Hong Kong",
        "Seoul",
        "Delhi",
        "New Delhi",
        "Mumbai",
    ]
)


def is_city(answer: str) -> bool:
    """Whether ``answer`` names a real city: the part before a comma ("Paris, France"), any case."""
    name = answer.split(",")[0].strip().strip(".").lower()
    return name in CITIES or name.removeprefix("the city of ").strip() in CITIES


def _ask(client: Any, model: str, prompt: str) -> str:
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=40,
        response_format=response_format,
    )
    return str(json.loads(out.choices[0].message.content)["city"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=600)
    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        cities = list(pool.map(lambda p: _ask(client, args.model, p[0]), CAPITAL_PROMPTS))
    elapsed = time.perf_counter() - started
    print("| prompt | city | real city | expected |\n| --- | --- | --- | --- |")
    for (prompt, expected), city in zip(CAPITAL_PROMPTS, cities, strict=True):
        print(f"| {prompt} | {city} | {'yes' if is_city(city) else 'no'} | {'yes' if city == expected else 'no'} |")
    real = sum(is_city(c) for c in cities)
    right = sum(c == e for c, (_, e) in zip(cities, CAPITAL_PROMPTS, strict=True))
    print(f"\n{real}/{len(cities)} real cities, {right}/{len(cities)} the expected one, in {elapsed:.1f} s")
    return 0 if real > len(cities) // 2 else 1


if __name__ == "__main__":
    sys.exit(main())

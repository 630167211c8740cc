"""What resolving a route costs per Kafka-native record (``router.route_table.RouteTable.resolve``, which the
router runs on its event loop for each record naming a route), by case, against the peer of a record that names
a version (no route: a dict miss).

Cases, run interleaved round by round (so a drift of a shared machine hits all of them alike); each round times
``--records`` records and the best round per case is reported:

* ``version (peer)``: the record names a version, not a route;
* ``split, sticky user``: weighted rendezvous over two versions, keyed by the record's ``user``;
* ``fast path, short prompt``: the prompt is counted with the fast model's tokenizer (``tokenizers``);
* ``fast path, long prompt``: over the character bound, so not tokenized at all.

The tokenizer is a tiny random model's (``make_tiny_model``: a real ``tokenizer.json``) unless ``--tokenizer``
names a model folder.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table
from router.route_table import RouteTable
from schemas import InferenceRequest

SHORT = "The river ran quietly past the old mill, and the miller's daughter watched it from the bridge."


def _table(folder: Path, tokenizer: Path) -> RouteTable:
    path = folder / "routes.yaml"
    path.write_text(
        "routes:\n"
        "  ab: {sticky: user, targets: [{model: v1, weight: 50}, {model: v2, weight: 50}]}\n"
        "  fast:\n"
        "    targets: [{model: big, weight: 1}]\n"
        f"    fast_path: {{model: small, max_prompt_tokens: 64, tokenizer: {tokenizer}}}\n"
    )
    return RouteTable(path)


def _cases(records: int) -> dict[str, list[InferenceRequest]]:
    def make(model: str, prompt: str) -> list[InferenceRequest]:
        return [
            InferenceRequest(request_id=f"r{i}", model=model, prompt=prompt, user=f"user-{i}") for i in range(records)
        ]

    return {
        "version (peer)": make("v1", SHORT),
        "split, sticky user": make("ab", SHORT),
        "fast path, short prompt": make("fast", SHORT),
        "fast path, long prompt": make("fast", SHORT * 40),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokenizer", type=Path, help="a model folder holding tokenizer.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tokenizer = args.tokenizer
        if tokenizer is None:
            from gpu_workers.engine.models.random_checkpoint import make_tiny_model

            tokenizer = make_tiny_model(folder / "tiny", arch="llama", num_layers=2, hidden_size=64)
        table = _table(folder, tokenizer)
        cases = _cases(args.records)
        best = dict.fromkeys(cases, float("inf"))
        for _ in range(args.rounds):
            for name, requests in cases.items():
                started = time.perf_counter()
                for request in requests:
                    table.resolve(request)
                best[name] = min(best[name], (time.perf_counter() - started) / len(requests))
    peer = best["version (peer)"]
    rows = [(name, f"{seconds * 1e6:.2f}", f"{seconds / peer:.1f}x") for name, seconds in best.items()]
    print(markdown_table(("case", "us per record (best round)", "vs peer"), rows))


if __name__ == "__main__":
    main()

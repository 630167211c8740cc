"""The llama-cpp-python side of ``benchmarks.vs_llamacpp``, run by the benchmark's own environment's Python
(``.bench-env/llamacpp/bin/python``), so llama-cpp-python never enters the project's environment.

It speaks JSON lines on stdin/stdout, one request per line, one answer per line:

- ``{"op": "load", "model": PATH, "threads": N, "n_ctx": N}`` -> ``{"ok": true, "version": "0.3.36",
  "system_info": "CPU : SSE3 = 1 | ..."}``
- ``{"op": "run", "prompts": [[ids], ...], "tokens": N}`` -> ``{"ok": true, "seconds": [...], "tokens": [[ids],
  ...], "texts": [...]}``: the prompts one after another (concurrency 1), each decoded greedily for exactly
  ``tokens`` tokens (an end-of-text token does not stop it, as ``ignore_eos`` does in the engine), timed from
  before its prompt is evaluated to its last token.
- ``{"op": "quit"}`` ends it. A failure answers ``{"ok": false, "error": "..."}``.

Only the standard library and ``llama_cpp`` are imported: this file must run in that environment alone.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _generate(llm: Any, prompt: list[int], tokens: int) -> list[int]:
    out: list[int] = []
    # temp 0 is greedy in llama-cpp-python's sampler chain; repeat penalty off, as in the engine's greedy run.
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) >= tokens:
            break
    return out


def main() -> int:
    llm: Any = None
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            if request["op"] == "quit":
                break
            if request["op"] == "load":
                import llama_cpp

                llm = llama_cpp.Llama(
                    model_path=request["model"],
                    n_threads=request["threads"],
                    n_threads_batch=request["threads"],
                    n_ctx=request["n_ctx"],
                    n_gpu_layers=0,
                    verbose=False,
                )
                answer: dict[str, Any] = {
                    "ok": True,
                    "version": llama_cpp.__version__,
                    # The instruction sets llama.cpp was built for (AVX512, AVX512_BF16, ...): was it native?
                    "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
                }
            elif request["op"] == "run":
                seconds, outputs, texts = [], [], []
                for prompt in request["prompts"]:
                    started = time.perf_counter()
                    generated = _generate(llm, prompt, request["tokens"])
                    seconds.append(time.perf_counter() - started)
                    outputs.append(generated)
                    texts.append(llm.detokenize(generated).decode("utf-8", errors="replace"))
                answer = {"ok": True, "seconds": seconds, "tokens": outputs, "texts": texts}
            else:
                answer = {"ok": False, "error": f"unknown op {request['op']!r}"}
        except Exception as exc:  # reported to the benchmark, which says what failed
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

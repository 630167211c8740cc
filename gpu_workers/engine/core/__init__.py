"""The engine's core loop: admit requests, schedule them over the paged KV cache, step, report deltas.

``llm_engine.LLMEngine`` drives one step at a time; ``scheduler`` picks the work, ``block_manager`` owns the
KV blocks, ``sequence`` is a request's state inside the engine, ``request`` the value a front end hands in
and ``admission`` its check against the model. The front ends live in ``..entrypoints``; the forward pass
and sampling in ``..execution``.
"""

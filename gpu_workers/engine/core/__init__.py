"""The engine's state and bookkeeping: requests, their sequences, the schedule over the paged KV cache, deltas.

``scheduler`` picks the work, ``block_manager`` owns the KV blocks, ``sequence`` is a request's state inside the
engine and ``sequence_factory`` builds it (detokenizer, a seeded choice's keyed random draws from ``counter_rng``,
grammar matcher), ``request`` is the value a front end hands in and ``admission`` its check against the model;
``choices`` forks the further choices of a request, ``deltas`` applies stop rules and reports progress.

These are leaf types: the driver that steps them, ``..llm_engine.LLMEngine``, stands above this package, beside the
forward pass and sampling (``..execution``), speculative decoding (``..spec_decode``) and tensor parallelism
(``..distributed``), which all read these types; nothing here imports any of them, nor the front ends
(``..entrypoints``).
"""

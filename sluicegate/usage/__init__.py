"""Who used how many tokens, and how many they may use: the usage ledger's records (:mod:`.ledger`), the rollup of
``llm.usage`` into per-tenant aggregates in Redis (:mod:`.rollup`) and the reports read from them (:mod:`.report`),
and token quotas per API key and per tenant, reserved at admission and settled at the end (:mod:`.quota`).

Shared by ingress (OpenAI, native and response-cache requests, ``GET /v1/usage``), the router (Kafka-native
records, and the rollup it runs), the batch service (batch lines) and the GPU worker (the records of the requests
it ends).
"""

"""Multi-LoRA serving: the adapter registry in Redis, the load-time check a live worker answers, and
the one resolution of a model name that is an adapter into base model + adapter."""

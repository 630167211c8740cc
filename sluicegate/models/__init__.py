"""Real model files the stack serves by default, fetched from a package registry (never a model hub)."""

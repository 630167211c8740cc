"""Unit tests of the inference engine (CPU, fp32, tiny random models)."""

"""Ingress: the FastAPI app that authenticates, validates and publishes inference requests to Kafka."""

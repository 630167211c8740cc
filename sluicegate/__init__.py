"""Shared runtime for Sluicegate services: settings, Kafka and Redis clients, logging, the CLI
and the local dev stack."""

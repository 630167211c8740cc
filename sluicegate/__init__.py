"""Shared runtime for Sluicegate services: settings, Kafka and Redis clients, telemetry, the CLI and the local dev stack."""

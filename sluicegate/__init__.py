"""Shared runtime for Sluicegate services: settings, Kafka and Redis clients, logging, stream tokens and the
other small libraries the services share. The command line and the local dev stack live on top of it, in ``cli``."""

"""``sluicegate bench``: a load generator for OpenAI-compatible endpoints and for Sluicegate's own paths."""

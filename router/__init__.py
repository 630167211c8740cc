"""Routing policy (topic and partition key per request) as a library, plus a stream processor for Kafka-native producers."""

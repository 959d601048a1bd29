"""The relay sidecar: promotes committed outbox records to Kafka with Kafka transactions."""

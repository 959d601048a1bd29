"""Transactional outbox for Kafka: publish records inside your own psycopg transaction."""

__all__: list[str] = []

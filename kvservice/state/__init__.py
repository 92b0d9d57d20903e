"""Durable and replicated state: the journal, snapshots, and their stores (memory, SQLite, NATS)."""

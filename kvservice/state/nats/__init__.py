"""The journal's replicated backend on NATS JetStream, its direct publisher and the leader lease."""

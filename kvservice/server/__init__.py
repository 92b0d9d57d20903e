"""The manager's process: gRPC adapters (servicer, streams, watch), metrics, HA wiring, config and CLI."""

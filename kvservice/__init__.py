"""kvservice: the central block manager for paged KV caches (domain core + gRPC adapter)."""

__version__ = "0.1.0"

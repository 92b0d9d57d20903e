"""The manager: named pools behind their locks, worker registry, the API as plain methods, routing."""

"""KV events: the per-pool event log (hub), its proto form, metrics and the vLLM-format ZeroMQ publisher."""

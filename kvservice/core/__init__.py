"""The domain core: geometry, planning, slot allocation, rows, the prefix cache and the pool's Step.

Plain Python and NumPy; no gRPC, no storage, no threads. Everything above it (manager, state, server) calls it."""

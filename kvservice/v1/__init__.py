"""Generated protobuf and gRPC stubs for package kvservice.v1 (do not edit; run scripts/gen_protos.py)."""

"""Generated gRPC/protobuf stubs (scripts/gen_stubs.py). Do not edit."""

"""Generated gRPC stubs (see generate.py); `from kvfs.proto import chunk_pb2`."""

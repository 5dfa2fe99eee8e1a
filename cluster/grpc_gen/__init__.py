"""Generated gRPC stubs of ``proto/ditserve/v1/ditserve.proto`` (``build.py`` regenerates them)."""

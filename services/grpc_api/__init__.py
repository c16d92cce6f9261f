"""The gRPC face: the grpc.aio server, its interceptor chain (logs, tracing, auth), the ServiceError ->
status mapping, and the servicers, each RPC a few lines over the calls in services/calls/."""

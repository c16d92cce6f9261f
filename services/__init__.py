"""The gRPC face of omnivox: server, servicers, request validation, errors and the `omnivox` command."""

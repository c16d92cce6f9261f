"""The systems a benchmark run compares: omnivox behind its gRPC server, and the peers a user would pick instead."""

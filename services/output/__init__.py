"""Output processing: the engine's outputs -> responses (text deltas, tool-call and reasoning rewrites,
audio frames, summaries, transcript segments). Nothing here imports grpc."""

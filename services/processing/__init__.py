"""Request processing: a wire request -> what the engine takes (limits, field checks, prompts,
grammars and tool plans, reasoning gates, cascade, voice and Whisper options). Nothing here imports grpc."""

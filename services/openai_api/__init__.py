"""The OpenAI-compatible fronts on `serve --http-port`: chat, completions, speech, transcriptions and
the realtime WebSocket, over the same calls, processing and output as gRPC."""

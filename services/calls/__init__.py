"""One call from a wire request to its responses, whichever front carries it: admit -> process ->
engine -> output, and the engine runs they drive (Whisper windows, audio-LLM windows, voices)."""

"""Model parts: what a served model holds (decoder, speech codec, Whisper, audio and image encoders, voices),
found by the table in table.py, loaded into bundles, served by name from the registry; the embedded defaults."""

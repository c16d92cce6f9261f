"""Non-autoregressive voices: text -> phonemes -> one ONNX model run per utterance -> float PCM, no engine step.

Two families behind one interface (`VoiceModel`, voice_model.py):
- hibari (hibari.py): an English voice distilled from Kokoro-82M, its own grapheme-to-phoneme step, 24 kHz;
- Piper (piper.py): the rhasspy/Piper format (`voice.onnx` + `voice.onnx.json`), VITS, phonemes from espeak-ng.

Nothing here knows of gRPC, codecs or services: the speech worker (services/parts/voice_part.py) runs these off the loop.
"""

from omnivox.models.voice.voice_model import NothingToSay, UnknownVoice, VoiceModel, VoiceNeedsDownload

__all__ = ["NothingToSay", "UnknownVoice", "VoiceModel", "VoiceNeedsDownload"]

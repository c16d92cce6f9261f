"""The Piper voice format (rhasspy/piper): `NAME.onnx` (VITS) + `NAME.onnx.json`, read here from the format itself
(piper-tts is GPL since 1.3; nothing of it is imported).

The JSON carries what synthesis needs: `audio.sample_rate`, `espeak.voice` (the espeak-ng voice that phonemizes the
text), `phoneme_type` ("espeak", or "text": the text's own characters are the phonemes), `phoneme_map` (phoneme ->
replacement phonemes), `phoneme_id_map` (phoneme -> ids; "_" pad, "^" start, "$" end), `inference` (noise_scale,
length_scale, noise_w: the model's `scales` input), `num_speakers` and `speaker_id_map` (name -> the `sid` input).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PAD, BOS, EOS = "_", "^", "$"


@dataclass(frozen=True)
class PiperConfig:
    sample_rate: int
    espeak_voice: str
    phoneme_type: str  # "espeak" or "text"
    phoneme_id_map: dict[str, tuple[int, ...]]
    phoneme_map: dict[str, tuple[str, ...]]
    noise_scale: float
    length_scale: float
    noise_w: float
    num_speakers: int
    speaker_id_map: dict[str, int]
    language_code: str  # BCP-47 ("en-US"; the file says "en_US")
    dataset: str

    @classmethod
    def load(cls, path: Path) -> PiperConfig:
        """ValueError naming the key when the file is not a Piper voice config."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable JSON file ({exc})") from None

        def need(*keys: str):
            value = data
            for key in keys:
                if not isinstance(value, dict) or key not in value:
                    raise ValueError(f"{path}: a Piper voice config needs {'.'.join(keys)}")
                value = value[key]
            return value

        id_map = {str(k): tuple(int(i) for i in (v if isinstance(v, list) else [v])) for k, v in
                  need("phoneme_id_map").items()}  # fmt: skip
        for symbol in (PAD, BOS, EOS):
            if symbol not in id_map:
                raise ValueError(f"{path}: phoneme_id_map has no {symbol!r}")
        phoneme_type = str(data.get("phoneme_type", "espeak"))
        if phoneme_type not in ("espeak", "text"):
            raise ValueError(f"{path}: phoneme_type {phoneme_type!r} is not served (espeak, text)")
        inference = data.get("inference", {})
        language = data.get("language", {})
        code = str(language.get("code") or data.get("espeak", {}).get("voice", "und")).replace("_", "-")
        return cls(
            sample_rate=int(need("audio", "sample_rate")),
            espeak_voice=str(data.get("espeak", {}).get("voice", "en-us")),
            phoneme_type=phoneme_type,
            phoneme_id_map=id_map,
            phoneme_map={str(k): tuple(v) for k, v in (data.get("phoneme_map") or {}).items()},
            noise_scale=float(inference.get("noise_scale", 0.667)),
            length_scale=float(inference.get("length_scale", 1.0)),
            noise_w=float(inference.get("noise_w", 0.8)),
            num_speakers=int(data.get("num_speakers", 1)),
            speaker_id_map={str(k): int(v) for k, v in (data.get("speaker_id_map") or {}).items()},
            language_code=code,
            dataset=str(data.get("dataset") or ""),
        )

    def ids(self, phonemes: str) -> tuple[int, ...]:
        """Piper's id sequence: start, pad, then each known phoneme followed by a pad, then end (unknown ones are
        dropped, as Piper drops them)."""
        pad = self.phoneme_id_map[PAD]
        out = [*self.phoneme_id_map[BOS], *pad]
        for ch in phonemes:
            for p in self.phoneme_map.get(ch, (ch,)):
                if (ids := self.phoneme_id_map.get(p)) is not None:
                    out += [*ids, *pad]
        out += self.phoneme_id_map[EOS]
        return tuple(out)

    def speakers(self) -> dict[str, int]:
        """Voice name -> speaker id: the map's names, else "0".."N-1"; one speaker: the dataset's name, id 0."""
        if self.num_speakers <= 1:
            return {self.dataset or "default": 0}
        return dict(self.speaker_id_map) or {str(i): i for i in range(self.num_speakers)}


def find_piper_voice(path: Path) -> tuple[Path, Path] | None:
    """(model.onnx, model.onnx.json) of a Piper voice: the .onnx file itself, or the one such pair in a folder."""
    if path.is_file() and path.suffix == ".onnx":
        config = path.with_name(path.name + ".json")
        return (path, config) if config.is_file() else None
    if path.is_dir():
        pairs = [(m, m.with_name(m.name + ".json")) for m in sorted(path.glob("*.onnx"))]
        pairs = [(m, c) for m, c in pairs if c.is_file()]
        return pairs[0] if len(pairs) == 1 else None
    return None

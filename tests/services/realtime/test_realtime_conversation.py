"""The session's conversation and settings without a server: truncation keeps the clauses heard (the one playing cut
at a word), items become the chat messages the text model reads, bad settings name their field."""

from __future__ import annotations

import pytest

from omnivox.services.openai_api.realtime.config import SessionConfig
from omnivox.services.openai_api.realtime.conversation import Conversation, Spoken, check_item
from omnivox.services.openai_api.realtime.protocol import RealtimeError


def test_spoken_heard_keeps_whole_clauses_then_a_word_cut() -> None:
    spoken = Spoken([(0, 1000, "The capital of France"), (1000, 2000, "is Paris, a large city.")])
    assert spoken.heard(2000) == "The capital of France is Paris, a large city."
    assert spoken.heard(1000) == "The capital of France"
    assert spoken.heard(1500) == "The capital of France is Paris, a"  # 12 of 23 characters: the words ended by then
    assert spoken.heard(100) == ""


def test_truncate_trims_the_transcript_and_checks_its_fields() -> None:
    conversation = Conversation()
    item = check_item({"type": "message", "role": "assistant",
                       "content": [{"type": "output_audio", "transcript": "One two. Three four."}]})  # fmt: skip
    conversation.add(item)
    conversation.spoken[item["id"]] = Spoken([(0, 500, "One two."), (500, 1000, "Three four.")])
    with pytest.raises(RealtimeError) as info:
        conversation.truncate(item["id"], 0, 5000)
    assert info.value.param == "audio_end_ms"
    conversation.truncate(item["id"], 0, 600)
    assert item["content"][0]["transcript"] == "One two."
    assert conversation.messages("Be brief.")[-1] == {"role": "assistant", "content": "One two."}


def test_items_become_chat_messages_with_tool_calls() -> None:
    conversation = Conversation()
    for raw in (
        {"type": "message", "role": "user", "content": [{"type": "input_audio", "transcript": "Weather in Oslo?"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
    ):
        conversation.add(check_item(raw))
    assert conversation.messages("") == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function":
                                                               {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("session", "param"),
    [
        ({"output_modalities": ["text", "audio"]}, "session.output_modalities"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.input.format.rate"),
        ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, "session.audio.input.turn_detection.type"),
        ({"audio": {"input": {"turn_detection": {"threshold": 2}}}}, "session.audio.input.turn_detection.threshold"),
        ({"audio": {"output": {"speed": 3}}}, "session.audio.output.speed"),
        ({"tools": [{"type": "function"}]}, "session.tools[0]"),
        ({"max_output_tokens": 0}, "session.max_output_tokens"),
        ({"model": "other"}, "session.model"),
    ],
)
def test_bad_settings_name_their_field_and_change_nothing(session, param) -> None:
    config = SessionConfig(model="m")
    with pytest.raises(RealtimeError) as info:
        config.updated(session)
    assert info.value.param == param
    assert config == SessionConfig(model="m")


def test_turn_detection_null_then_back() -> None:
    config = SessionConfig(model="m").updated({"audio": {"input": {"turn_detection": None}}})
    assert config.turn_detection is None and config.wire("s")["audio"]["input"]["turn_detection"] is None
    again = config.updated({"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 800}}}})
    assert again.turn_detection is not None and again.turn_detection.silence_duration_ms == 800

"""Realtime voice sessions: `GET /v1/realtime?model=...`, a WebSocket speaking the OpenAI Realtime GA protocol.

One session is a cascade over the served models: the input audio buffer (services/openai_api/realtime/audio_io.py) -> the voice
activity detector and Whisper (services/openai_api/realtime/turns.py) -> the text model over the conversation kept in the
session (services/openai_api/realtime/conversation.py, through services/calls/generate_call.py like every Generate) -> the voice
speaking clause by clause as the text streams (services/openai_api/realtime/response.py). services/openai_api/realtime/session.py holds a
session's state and dispatches client events; services/openai_api/realtime/route.py is the WebSocket route (auth, limits,
drain); services/openai_api/realtime/protocol.py builds the wire events.
"""

"""Realtime voice sessions: `GET /v1/realtime?model=...`, a WebSocket speaking the OpenAI Realtime GA protocol.

One session is a cascade over the served models: the input audio buffer (services/realtime/audio_io.py) -> the voice
activity detector and Whisper (services/realtime/turns.py) -> the text model over the conversation kept in the
session (services/realtime/conversation.py, through services/generate_call.py like every Generate) -> the voice
speaking clause by clause as the text streams (services/realtime/response.py). services/realtime/session.py holds a
session's state and dispatches client events; services/realtime/route.py is the WebSocket route (auth, limits,
drain); services/realtime/protocol.py builds the wire events.
"""

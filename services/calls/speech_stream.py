"""StreamingSynthesizeSpeech: text streamed in (as an LLM writes it), audio streamed out.

    config -> text chunks -> end      (client)
    format -> audio chunks -> summary (server, as SynthesizeSpeech)

Text is cut into clauses as it arrives (`ClauseCutter`: after , ; : . ! ? followed by a space, after CJK punctuation
(。！？，、；：, which no space follows), or at a space once a clause reaches max_clause_chars). Text that ends at such
punctuation with nothing after it is a complete clause once no more text comes for SETTLE_S (it may still be "3.5" or
"?!" arriving token by token): a client that sends one sentence and waits for its audio before sending more gets it.
Clauses are synthesised one after another, each with the previous clause's text and its last CONTEXT_FRAMES of codes
as a prior turn (`SpeechLayout.build_reference_prompt`), so the voice and prosody carry over. All clauses' frames go
into ONE codec stream: the streaming decoder's windows and crossfade run across clause joins exactly as within a
clause, so the joins have no seam of their own. When a clause is spoken and the next one's text has not come, the
codec stream is flushed: the clause's last window (up to a hop plus the lookahead frame, ~1.5 s of audio) goes out
now, not when the next clause's frames come (the flushed end is decoded as an utterance's end is; the next clause's
audio continues from it with its left context, in chunks growing from the first hop again).

Latency trade-off: a clause starts synthesising when it is complete, so first audio comes roughly one clause (plus a
few frames of generation) after its first word; a shorter max_clause_chars means earlier first audio but less text
per prompt (the model sees less of the sentence it is speaking).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from omnivox.engine import InvalidRequest
from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.metrics import SpeechStreamMetrics
from omnivox.services.output.clause_synthesis import ClauseSynthesis
from omnivox.services.output.summaries import speech_summary
from omnivox.services.processing import speech_request
from omnivox.services.processing.cache_salt import request_salt
from omnivox.services.processing.clauses import DEFAULT_MAX_CLAUSE_CHARS, SETTLE_S, ClauseCutter
from omnivox.services.processing.speech_validation import invalid
from omnivox.services.processing.streams import first_config
from omnivox.v1 import speech_pb2

if TYPE_CHECKING:
    from omnivox.services.calls.speech_call import SpeechCalls

Response = speech_pb2.StreamingSynthesizeSpeechResponse


async def streaming_synthesize(
    calls: SpeechCalls, requests: AsyncIterator[speech_pb2.StreamingSynthesizeSpeechRequest]
) -> AsyncIterator[Response]:
    """The format, the audio chunks as each clause is spoken, then the summary."""
    received = time.monotonic()
    cfg = await first_config(requests)
    salt = request_salt(cfg.cache_salt, "config.cache_salt")  # this caller's share of the prefix cache
    limits = calls.limits
    if cfg.max_clause_chars < 0 or cfg.max_clause_chars > limits.max_segment_chars:
        raise errors.invalid_argument(
            [FieldViolation("config.max_clause_chars", f"must be in [0, {limits.max_segment_chars}]")]
        )
    with speech_request.config_fields():  # the checks of SynthesizeSpeech, their fields named `config.<field>`
        model = speech_request.speech_model(calls.registry, cfg.model)
    if model.bundle is not None and model.bundle.voice is not None:  # no engine: services/calls/voice_speech.py
        from omnivox.services.calls.voice_speech import stream_voice

        # Outside config_fields: stream_voice names its config fields itself, and its later errors (the text
        # messages) are not config fields (inside, they came out as `config.config.audio_config...`, `config.text`).
        async for response in stream_voice(calls, cfg, requests, model, received):
            yield response
        return
    with speech_request.config_fields():
        created = {v.name: v for v in calls.voices.list(model.name)}
        plan = speech_request.check_stream_config(cfg, model, limits, created)
    assert model.bundle is not None and model.bundle.speech is not None
    ref = created.get(plan.voice) if plan.voice not in model.bundle.speech.layout.voices else None
    cutter = ClauseCutter(cfg.max_clause_chars or DEFAULT_MAX_CLAUSE_CHARS)
    synthesis = ClauseSynthesis(model, plan, cfg, cutter, limits, ref, salt, SETTLE_S)
    m = calls.metrics
    # Called once admitted: the arbiter puts it first when behind, but only while a clause is being spoken or its
    # codec decodes: waiting for the client's next text, its deadline passes and it is not behind (engine/arbiter.py).
    deadline = calls.registry.arbiter.open
    with (
        model.admit(),
        SpeechStreamMetrics(
            m,
            model.name,
            received,
            deadline=deadline(model.engine, working=lambda: synthesis.generating or synthesis.stream.decoding),
        ) as slo,
    ):
        try:
            yield Response(format=synthesis.audio_format())
            synthesis.start(requests, calls.registry.stream_idle_s)
            async for data in synthesis.audio(m.clause_first_audio.labels(model.name).observe):
                slo.chunk(synthesis.audio_seconds - slo.meter.sent_s, synthesis.last_out, synthesis.last_clause_ready())
                yield Response(audio=speech_pb2.AudioChunk(data=data))
        except InvalidRequest as err:
            raise invalid(err) from err
        except (asyncio.CancelledError, GeneratorExit):  # client gone, deadline, idle bound, forced stop: as vLLM
            m.request_ended(model.name, "abort")
            raise
        finally:
            await synthesis.close()
        done, totals = time.monotonic(), synthesis.totals
        totals.audio_seconds = synthesis.audio_seconds
        slo.finish(totals.audio_seconds, done)
        m.stream_clauses.labels(model.name).observe(len(synthesis.marks))
        if synthesis.text_end is not None and synthesis.first_audio is not None:
            m.text_end_lag.labels(model.name).observe(max(slo.last_audio - synthesis.text_end, 0.0))
        m.success.labels(model.name, totals.finish).inc()
        m.e2e.labels(model.name).observe(done - received)
    yield Response(
        summary=speech_summary(totals, received, done, synthesis.first_audio, synthesis.request_id, model.name)
    )

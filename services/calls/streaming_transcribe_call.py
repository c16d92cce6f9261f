"""One StreamingTranscribe from its request stream to its responses, whichever front carries it: the config
(streaming_transcribe_request.py) -> admit -> the stream's reader and passes (streaming_transcription.py
TranscriptStream) -> speech events and results as they come -> the summary (streaming_transcribe_output.py).

Leaving in any way (done, cancelled, deadline, error) cancels the reader, the finals task and every pass: each
pass's engine request is aborted (KV blocks and cross-attention state freed).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from omnivox.services.calls.streaming_transcription import TranscriptStream
from omnivox.services.metrics import Metrics
from omnivox.services.output import streaming_transcribe_output as output
from omnivox.services.parts.registry import ModelRegistry
from omnivox.services.processing import streaming_transcribe_request
from omnivox.services.processing.cache_salt import request_salt
from omnivox.services.processing.stream_idle import idle_bounded
from omnivox.services.processing.streams import first_config, next_item
from omnivox.v1 import transcription_pb2


async def streaming_transcribe(
    requests: AsyncIterator[transcription_pb2.StreamingTranscribeRequest], registry: ModelRegistry, metrics: Metrics
) -> AsyncIterator[output.Response]:
    cfg = await first_config(requests)
    salt = request_salt(cfg.cache_salt, "config.cache_salt")
    model = streaming_transcribe_request.whisper_model(registry, cfg.model)
    part = model.bundle.whisper  # type: ignore[union-attr]
    stream = TranscriptStream(part, cfg, streaming_transcribe_request.validate(part, cfg), salt)
    request_id = cfg.request_id or uuid.uuid4().hex
    with model.admit():
        messages = idle_bounded(
            requests, registry.stream_idle_s, "audio", lambda: bool(stream.passes), lambda req: bool(req.audio)
        )
        tasks = [asyncio.create_task(stream.read(messages)), asyncio.create_task(stream.run_finals())]
        try:
            while (item := await next_item(stream.out, tasks)) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            for task in [*tasks, *stream.passes]:
                task.cancel()
            await asyncio.gather(*tasks, *stream.passes, return_exceptions=True)
    first = stream.first_result
    waited = first - stream.first_audio if first is not None and stream.first_audio is not None else None
    yield output.summary(stream.texts, stream.count, stream.decoder.seconds_in, stream.compute_s, request_id,
                         model.name, waited, metrics)  # fmt: skip

"""Prometheus metrics: vLLM's names with an `omnivox_` prefix, plus the audio SLOs no peer exports.

Fed by events, never by polling: each engine's step observer reads the `StepResult` of every step (running, waiting,
KV usage, tokens, preemptions, drafts, queue time at admission, inter-token latency); the servicers report a request's
end (finish reason, end-to-end, prefill and decode time), a speech stream's chunks (time to first audio, underruns,
real-time factor) and a transcription's real-time factor; the call interceptor (services/grpc_api/logs.py) counts gRPC
statuses. Every metric carries a `model` label except the per-RPC status counter.

Each `Metrics` owns its CollectorRegistry, so that servers in one process (tests) never share counts.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily

from omnivox.engine import Engine, RequestOutput
from omnivox.engine.arbiter import PlaybackDeadline, StepArbiter
from omnivox.engine.core import StepResult
from omnivox.engine.request import Request

log = logging.getLogger(__name__)

MAX_REMEMBERED = 4096  # admission times kept for servicers (one per request that has its first token)

# Latency buckets (seconds) as vLLM's, which cover a CPU's ~3 ms steps and a long request's minutes.
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_LONG = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0)
_RTF = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)
_COUNT = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Tokens per request: vLLM's 1-2-5 series (it stops at the model's context; one registry serves every model here).
_TOKENS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))[:-2]  # 1 ... 1,000,000


class Metrics:
    """Every omnivox metric, in one registry. `serve(port)` exposes it over HTTP at /metrics."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.observers: dict[str, StepObserver] = {}
        m = ("model",)
        # Engine state (gauges) and work (counters), from step results.
        self.running = Gauge("omnivox_num_requests_running", "Requests in the engine's running set", m, registry=r)
        self.waiting = Gauge("omnivox_num_requests_waiting", "Requests waiting for admission", m, registry=r)
        self.kv_usage = Gauge("omnivox_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)", m, registry=r)
        self.prompt_tokens = Counter("omnivox_prompt_tokens", "Prompt tokens of admitted requests", m, registry=r)
        self.generation_tokens = Counter("omnivox_generation_tokens", "Tokens generated", m, registry=r)
        self.prefix_queries = Counter(
            "omnivox_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", m, registry=r
        )
        self.prefix_hits = Counter(
            "omnivox_prefix_cache_hits", "Prompt tokens served by the prefix cache", m, registry=r
        )
        self.preemptions = Counter("omnivox_num_preemptions", "Requests preempted (KV cache full)", m, registry=r)
        self.spec_drafts = Counter("omnivox_spec_decode_num_draft_tokens", "Draft tokens verified", m, registry=r)
        self.spec_accepted = Counter("omnivox_spec_decode_num_accepted_tokens", "Draft tokens accepted", m, registry=r)
        self.encoder_caches: list[tuple[str, str, Any]] = []  # (model, modality, EncoderCache): counted by the cache
        self.codecs: list[tuple[str, Any]] = []  # (model, DecodeWorker): timed by the worker
        r.register(_EncoderCacheCollector(self.encoder_caches, self.codecs))
        # Request latencies.
        self.ttft = Histogram(
            "omnivox_time_to_first_token_seconds", "Time to first token", m, buckets=_TTFT, registry=r
        )
        self.itl = Histogram("omnivox_inter_token_latency_seconds", "Inter-token latency", m, buckets=_ITL, registry=r)
        self.e2e = Histogram("omnivox_e2e_request_latency_seconds", "End-to-end latency", m, buckets=_LONG, registry=r)
        self.queue_time = Histogram(
            "omnivox_request_queue_time_seconds", "Arrival to first admission", m, buckets=_LONG, registry=r
        )
        self.prefill_time = Histogram(
            "omnivox_request_prefill_time_seconds", "First admission to first token", m, buckets=_LONG, registry=r
        )
        self.decode_time = Histogram(
            "omnivox_request_decode_time_seconds", "First token to the end", m, buckets=_LONG, registry=r
        )
        self.success = Counter("omnivox_request_success", "Finished requests", ("model", "finished_reason"), registry=r)
        self.request_prompt_tokens = Histogram(
            "omnivox_request_prompt_tokens", "Prompt tokens per finished request", m, buckets=_TOKENS, registry=r
        )
        self.request_generation_tokens = Histogram(
            "omnivox_request_generation_tokens", "Output tokens per finished request", m, buckets=_TOKENS, registry=r
        )
        self.grpc_status = Counter("omnivox_grpc_requests", "Finished RPCs", ("method", "grpc_code"), registry=r)
        # Audio out.
        self.ttfa = Histogram(
            "omnivox_time_to_first_audio_seconds", "Time to first audio", m, buckets=_TTFT, registry=r
        )
        self.speech_rtf = Histogram(
            "omnivox_speech_real_time_factor", "Compute seconds / audio seconds", m, buckets=_RTF, registry=r
        )
        self.audio_seconds = Counter("omnivox_audio_seconds", "Audio seconds produced", m, registry=r)
        self.speech_streams = Gauge("omnivox_speech_streams_active", "Speech streams open", m, registry=r)
        self.underruns = Counter(
            "omnivox_audio_underruns", "Chunks that arrived after the client's buffer ran dry", m, registry=r
        )
        self.underrun_seconds = Counter(
            "omnivox_audio_underrun_seconds", "Seconds the client's buffer was dry", m, registry=r
        )
        # Text streamed in (StreamingSynthesizeSpeech): per clause and per stream.
        self.stream_clauses = Histogram(
            "omnivox_speech_stream_clauses", "Clauses per streamed-text synthesis", m, buckets=_COUNT, registry=r
        )
        self.clause_first_audio = Histogram(
            "omnivox_speech_clause_first_audio_seconds",
            "Text chunk that completed a clause arrived -> that clause's first audio sent",
            m, buckets=_TTFT, registry=r,
        )  # fmt: skip
        self.text_end_lag = Histogram(
            "omnivox_speech_text_end_to_last_audio_seconds",
            "End of the streamed text -> the last audio sent (text-in to audio-out lag at the end)",
            m, buckets=_LONG, registry=r,
        )  # fmt: skip
        self.text_wait_seconds = Counter(
            "omnivox_speech_text_wait_seconds",
            "Seconds a streamed-text client's buffer was dry waiting for the text, not for the server",
            m, registry=r,
        )  # fmt: skip
        # The step arbiter (engine/arbiter.py): steps this model's engine yielded to another's audio stream behind its
        # playback deadline, the seconds they waited, and this model's streams behind now.
        self.arbiter_yields = Counter("omnivox_arbiter_yields", "Engine steps yielded to audio behind", m, registry=r)
        self.arbiter_yield_seconds = Counter(
            "omnivox_arbiter_yield_seconds", "Seconds engine steps waited for audio behind", m, registry=r
        )
        self.audio_streams_behind = Gauge(
            "omnivox_audio_streams_behind", "Audio streams (speech, transcription) behind their deadline", m, registry=r
        )
        # Audio in.
        self.transcription_rtf = Histogram(
            "omnivox_transcription_real_time_factor", "Compute seconds / audio seconds", m, buckets=_RTF, registry=r
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """HTTP /metrics on host:port (0: any free port); returns the port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_port

    def close(self) -> None:
        http = getattr(self, "_http", None)
        if http is not None:
            http.shutdown()
            http.server_close()

    # ---- feeding --------------------------------------------------------------------------------------------
    def attach(self, model: str, engine: Engine) -> None:
        """Observe every step of `engine` (idempotent per engine). The model's engine series exist from here, at 0
        (as vLLM's do from start-up): a replica that has served nothing yet is 0 waiting, not absent, to the
        autoscaler's average, `absent()` alerts and dashboards (they appeared only with its first request)."""
        if not any(isinstance(o, StepObserver) for o in engine.step_observers):
            self.observers[model] = StepObserver(self, model, engine)
            engine.step_observers.append(self.observers[model])
        engine_series = (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens)
        for series in (*engine_series, self.prefix_queries, self.prefix_hits, self.preemptions):
            series.labels(model)

    def watch_codec(self, model: str, worker: Any) -> None:
        if not any(w is worker for _, w in self.codecs):
            self.codecs.append((model, worker))

    def watch_arbiter(self, model: str, engine: Engine, arbiter: StepArbiter) -> None:
        """The arbiter's decisions about `engine` (idempotent per engine): its yields, and its streams behind."""
        if any(getattr(o, "engine", None) is engine for o in arbiter.yield_observers):
            return
        arbiter.yield_observers.append(ArbiterObserver(self, model, engine))
        self.arbiter_yields.labels(model)
        self.arbiter_yield_seconds.labels(model)
        self.audio_streams_behind.labels(model).set_function(lambda: sum(d.owner is engine for d in arbiter.behind()))

    def watch_encoder_cache(self, model: str, modality: str, cache: Any) -> None:
        if not any(c is cache for _, _, c in self.encoder_caches):
            self.encoder_caches.append((model, modality, cache))

    def admission(self, model: str, request_id: str) -> float | None:
        """When the engine first admitted `request_id` (time.monotonic()), once its first token came; then forgotten."""
        observer = self.observers.get(model)
        return observer.scheduled.pop(request_id, None) if observer is not None else None

    def request_ended(self, model: str, reason: str) -> None:
        """A request that ended without a last output to report: "abort" (the client cancelled, its deadline passed,
        the server stopped) or "error" (the engine failed its step); counted as vLLM counts them."""
        self.success.labels(model, reason).inc()

    def request_finished(self, model: str, out: RequestOutput) -> None:
        """A request's last output (from the servicer): finish reason, end-to-end and decode time."""
        now = time.monotonic()
        self.success.labels(model, out.finish_reason or "unknown").inc()
        self.e2e.labels(model).observe(max(now - out.arrival_time, 0.0))
        self.request_prompt_tokens.labels(model).observe(len(out.prompt_token_ids))
        self.request_generation_tokens.labels(model).observe(out.num_tokens)
        if out.first_token_time is not None:
            self.decode_time.labels(model).observe(max(now - out.first_token_time, 0.0))


@dataclass
class _Times:
    scheduled: float  # first admission
    last_token: float | None = None


class _EncoderCacheCollector:
    """omnivox_encoder_cache_{queries,hits}_total from the caches' own counters, and
    omnivox_codec_decode_seconds_total / omnivox_codec_decode_passes_total from the speech codec workers' own timers,
    read when scraped."""

    def __init__(self, caches: list[tuple[str, str, Any]], codecs: list[tuple[str, Any]]) -> None:
        self.caches = caches
        self.codecs = codecs

    def collect(self) -> Iterator[CounterMetricFamily]:
        labels = ["model", "modality"]
        queries = CounterMetricFamily("omnivox_encoder_cache_queries", "Image/audio items looked up", labels=labels)
        hits = CounterMetricFamily("omnivox_encoder_cache_hits", "Items served by the encoder cache", labels=labels)
        for model, modality, cache in self.caches:
            queries.add_metric([model, modality], cache.hits + cache.misses)
            hits.add_metric([model, modality], cache.hits)
        yield queries
        yield hits
        seconds = CounterMetricFamily(
            "omnivox_codec_decode_seconds", "Wall time of speech codec passes", labels=["model"]
        )
        passes = CounterMetricFamily(
            "omnivox_codec_decode_passes", "Speech codec passes (windows of all streams)", labels=["model"]
        )
        for model, worker in self.codecs:
            seconds.add_metric([model], worker.stats.decode_seconds)
            passes.add_metric([model], worker.stats.passes)
        yield seconds
        yield passes


class StepObserver:
    """One engine's step observer: runs on the engine thread after every step; never raises into the engine."""

    def __init__(self, metrics: Metrics, model: str, engine: Engine) -> None:
        self.m, self.model, self.engine = metrics, model, engine
        self.total_blocks = engine.kv_usage().total_blocks
        # Keyed by the Request object: an entry goes with its request, so no state outlives one.
        self.times: weakref.WeakKeyDictionary[Request, _Times] = weakref.WeakKeyDictionary()
        # request id -> first admission, from its first token until the servicer asks (tracing's queue span).
        # Bounded: entries of calls that never ask (cancelled ones) go oldest first.
        self.scheduled: dict[str, float] = {}

    def __call__(self, result: StepResult) -> None:
        try:
            self._observe(result)
        except Exception:  # metrics must never stop the engine
            log.exception("step observer failed")

    def _observe(self, result: StepResult) -> None:
        m, model, s = self.m, self.model, result.stats
        now = time.monotonic()
        # Gauges from the state at the step's end: StepStats' are taken before the stop rules finish requests,
        # and an idle engine runs no further step to correct them.
        scheduler = self.engine.scheduler
        m.running.labels(model).set(len(scheduler.running))
        m.waiting.labels(model).set(len(scheduler.waiting))
        if self.total_blocks:
            m.kv_usage.labels(model).set(1.0 - self.engine.pool.num_free / self.total_blocks)
        if s.num_preempted:
            m.preemptions.labels(model).inc(s.num_preempted)
        if s.num_drafted:
            m.spec_drafts.labels(model).inc(s.num_drafted)
            m.spec_accepted.labels(model).inc(s.num_accepted)
        # This observer runs after the step's outputs: the step (and so the admission) began `seconds` earlier.
        step_start = now - s.seconds
        for req in result.plan.admitted:
            if req in self.times:  # re-admitted after a preemption: counted once
                continue
            self.times[req] = _Times(step_start)
            m.queue_time.labels(model).observe(max(step_start - req.arrival_time, 0.0))
            n = len(req.prompt_token_ids)
            m.prompt_tokens.labels(model).inc(n)
            m.prefix_queries.labels(model).inc(n)
            m.prefix_hits.labels(model).inc(max(req.num_cached_tokens, 0))
        tokens = 0
        for acc in result.accepted:
            tokens += len(acc.token_ids)
            t = self.times.get(acc.request)
            if t is None:
                continue
            if t.last_token is not None:  # one gap per step per request (a multi-token step is one gap)
                m.itl.labels(model).observe(now - t.last_token)
            else:
                m.ttft.labels(model).observe(max(now - acc.request.arrival_time, 0.0))
                m.prefill_time.labels(model).observe(now - t.scheduled)
                self.scheduled[acc.request.request_id] = t.scheduled
                if len(self.scheduled) > MAX_REMEMBERED:
                    self.scheduled.pop(next(iter(self.scheduled)), None)  # the servicer may pop it too
            t.last_token = now
        if tokens:
            m.generation_tokens.labels(model).inc(tokens)


@dataclass
class ArbiterObserver:
    metrics: Metrics
    model: str
    engine: Engine

    def __call__(self, engine: Any, waited_s: float) -> None:
        if engine is self.engine and waited_s > 0:
            self.metrics.arbiter_yields.labels(self.model).inc()
            self.metrics.arbiter_yield_seconds.labels(self.model).inc(waited_s)


class UnderrunMeter:
    """When would a client playing the stream run dry? A model of the client: it starts playing once it holds
    `buffer_s` seconds of audio (or at the end), plays in real time, and when its buffer runs dry it stalls until the
    next chunk arrives, then plays on. A chunk arriving after the audio sent so far could have finished playing is
    an underrun of (arrival - that moment) seconds, unless the chunk's text itself arrived after that moment (text
    streamed in: `ready`), when the client was waiting for its own text (counted as `text_wait_s`, not an underrun)."""

    def __init__(self, buffer_s: float = 0.2) -> None:
        self.buffer_s = buffer_s
        self.sent_s = 0.0  # audio seconds sent so far
        self.play_start: float | None = None  # when sample 0 would have played (shifted by every stall)
        self.count = 0
        self.seconds = 0.0
        self.text_wait_s = 0.0

    def chunk(self, arrival: float, seconds: float, ready: float | None = None) -> float:
        """A chunk of `seconds` of audio sent at `arrival`, whose text was complete at `ready` (None: from the start);
        returns the underrun it caused (0.0: none)."""
        gap = 0.0
        if self.play_start is not None:
            dry_at = self.play_start + self.sent_s
            if arrival > dry_at:
                gap = arrival - dry_at
                self.play_start += gap
                if ready is not None and ready > dry_at:
                    self.text_wait_s += gap
                    gap = 0.0
                else:
                    self.count += 1
                    self.seconds += gap
        self.sent_s += seconds
        if self.play_start is None and self.sent_s >= self.buffer_s:
            self.play_start = arrival
        return gap


class SpeechStreamMetrics:
    """One speech stream's audio SLOs: `chunk()` per chunk sent, `finish()` at the end (or never, if it failed)."""

    def __init__(
        self,
        metrics: Metrics,
        model: str,
        received: float,
        buffer_s: float = 0.2,
        deadline: PlaybackDeadline | None = None,
    ) -> None:
        """deadline: the stream's playback deadline the step arbiter reads (engine/arbiter.py), moved on each chunk
        to when the modelled client runs dry and closed at the end."""
        self.m, self.model, self.received, self.deadline = metrics, model, received, deadline
        self.meter = UnderrunMeter(buffer_s)
        self.first_audio: float | None = None
        self.last_audio: float | None = None

    def __enter__(self) -> SpeechStreamMetrics:
        self.m.speech_streams.labels(self.model).inc()
        return self

    def __exit__(self, *exc: object) -> None:
        self.m.speech_streams.labels(self.model).dec()
        if self.deadline is not None:
            self.deadline.close()

    def chunk(self, seconds: float, now: float | None = None, ready: float | None = None) -> None:
        """`seconds` of audio sent at `now`; `ready`: when its text was complete (text streamed in), else None."""
        now = time.monotonic() if now is None else now
        self.last_audio = now
        if self.first_audio is None:
            self.first_audio = now
            self.m.ttfa.labels(self.model).observe(now - self.received)
        waited = self.meter.text_wait_s
        gap = self.meter.chunk(now, seconds, ready)
        if gap > 0:
            self.m.underruns.labels(self.model).inc()
            self.m.underrun_seconds.labels(self.model).inc(gap)
        if self.meter.text_wait_s > waited:
            self.m.text_wait_seconds.labels(self.model).inc(self.meter.text_wait_s - waited)
        self.m.audio_seconds.labels(self.model).inc(seconds)
        if self.deadline is not None and self.meter.play_start is not None:
            self.deadline.update(self.meter.play_start + self.meter.sent_s)

    def finish(self, audio_seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if audio_seconds > 0:
            self.m.speech_rtf.labels(self.model).observe((now - self.received) / audio_seconds)

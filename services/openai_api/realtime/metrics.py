"""Realtime sessions' metrics, in the server's one Prometheus registry (services/metrics.py `Metrics.registry`):
sessions open, responses by final status, a spoken turn's latency (turn detected -> its answer's first audio delta
queued for the socket) and a barge-in's (speech detected -> the cancelled response fully stopped)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0)


class RealtimeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        m = ("model",)
        self.sessions = Gauge("omnivox_realtime_sessions_active", "Realtime sessions open", m, registry=registry)
        self.responses = Counter(
            "omnivox_realtime_responses", "Realtime responses by final status", ("model", "status"), registry=registry
        )
        self.turn_first_audio = Histogram(
            "omnivox_realtime_turn_first_audio_seconds",
            "A spoken turn's end detected (speech_stopped) -> its answer's first audio delta queued",
            m, buckets=_SECONDS, registry=registry,
        )  # fmt: skip
        self.barge_in = Histogram(
            "omnivox_realtime_barge_in_seconds",
            "Speech detected while a response ran -> that response stopped (engine request aborted, voice stopped)",
            m, buckets=_SECONDS, registry=registry,
        )  # fmt: skip

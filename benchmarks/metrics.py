"""From per-request timestamps to the figures we report for one concurrency level.

Definitions (all times in seconds, from one monotonic clock on the client):
- TTFT: first token received - request sent.
- ITL: gap between two consecutive tokens of one request (tokens that arrive in one chunk share its time, gap 0).
- per-user TPS (a latency): (tokens - 1) / (last token time - first token time), per request; we report the mean
  and p50 over requests.
- total TPS (a throughput): all output tokens of the level / (last token received - first request sent).
- request latency: last token received - request sent.
- prefix-cache hit rate: prompt tokens served from the cache / all prompt tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class RequestTrace:
    """What the client saw of one request."""

    index: int
    send_time: float
    token_times: list[float] = field(default_factory=list)  # one per output token, non-decreasing
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the system does not report it
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_times)

    def add_tokens(self, n: int, t: float) -> None:
        self.token_times.extend([t] * n)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass
class LevelMetrics:
    system: str
    concurrency: int
    num_requests: int
    num_errors: int
    output_tokens: int
    duration_s: float
    total_tps: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    per_user_tps_mean: float
    per_user_tps_p50: float
    latency_p50_s: float
    latency_p99_s: float
    prefix_cache_hit_rate: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(system: str, concurrency: int, traces: list[RequestTrace]) -> LevelMetrics:
    ok = [t for t in traces if t.error is None and t.token_times]
    errors = len(traces) - len(ok)
    ttft = [t.token_times[0] - t.send_time for t in ok]
    itl = [b - a for t in ok for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    per_user = []
    for t in ok:
        span = t.token_times[-1] - t.token_times[0]
        if t.num_tokens > 1 and span > 0:
            per_user.append((t.num_tokens - 1) / span)
    latency = [t.token_times[-1] - t.send_time for t in ok]
    tokens = sum(t.num_tokens for t in ok)
    if ok:
        duration = max(t.token_times[-1] for t in ok) - min(t.send_time for t in ok)
    else:
        duration = 0.0
    cached = [t for t in ok if t.cached_tokens is not None]
    prompt_total = sum(t.prompt_tokens for t in cached)
    hit_rate = sum(t.cached_tokens for t in cached) / prompt_total if cached and prompt_total else None
    return LevelMetrics(
        system=system,
        concurrency=concurrency,
        num_requests=len(traces),
        num_errors=errors,
        output_tokens=tokens,
        duration_s=duration,
        total_tps=tokens / duration if duration > 0 else math.nan,
        ttft_p50_ms=1e3 * percentile(ttft, 50),
        ttft_p90_ms=1e3 * percentile(ttft, 90),
        ttft_p99_ms=1e3 * percentile(ttft, 99),
        itl_p50_ms=1e3 * percentile(itl, 50),
        itl_p99_ms=1e3 * percentile(itl, 99),
        per_user_tps_mean=_mean(per_user),
        per_user_tps_p50=percentile(per_user, 50),
        latency_p50_s=percentile(latency, 50),
        latency_p99_s=percentile(latency, 99),
        prefix_cache_hit_rate=hit_rate,
    )

"""Metrics over HTTP /metrics after text and speech requests; the underrun model against scripted send times; one
JSON log line per RPC that never holds the prompt."""

from __future__ import annotations

import json
import logging
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, user_request

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.metrics import Metrics, SpeechStreamMetrics, UnderrunMeter
from omnivox.services.parts.defaults import save_random_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, generation_pb2_grpc, speech_pb2, speech_pb2_grpc

SMALL_SNAC = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
CANARY = "zebra-canary-7f3a91"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ops")
    text = make_checkpoint(root / "tiny", family="llama")
    speech = save_random_speech_model(root / "orpheus-random", snac_config=SMALL_SNAC)
    specs = [ModelSpec(path=text, name="tiny"), ModelSpec(path=speech, name="speech")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.02), metrics_port=0) as srv:
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = 0.3  # the random decoder speaks for its whole budget: keep it short
        servicer.limits.audio_seconds_per_char = 0.0
        yield srv


def scrape(srv: ServerThread) -> dict:
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(body)}


def value(families: dict, family: str, sample: str, **labels: str) -> float:
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{sample} {labels}")


def test_scrape_after_text_and_speech_requests(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
    caplog.set_level(logging.INFO, logger="omnivox.requests")
    n = 3
    outputs = 0
    for _ in range(n):
        responses = list(stub.Generate(user_request(f"Say {CANARY} back.", max_output_tokens=5, ignore_eos=True)))
        outputs += responses[-1].summary.usage.output_tokens
    speech = speech_pb2_grpc.SpeechServiceStub(server.channel())
    request = speech_pb2.SynthesizeSpeechRequest(
        text=f"Hello {CANARY}.",
        audio_config=speech_pb2.AudioConfig(encoding=content_pb2.AudioEncoding.AUDIO_ENCODING_LINEAR16),
    )
    summary = list(speech.SynthesizeSpeech(request, timeout=120))[-1].summary

    f = scrape(server)
    types = {
        "omnivox_time_to_first_token_seconds": "histogram",
        "omnivox_inter_token_latency_seconds": "histogram",
        "omnivox_e2e_request_latency_seconds": "histogram",
        "omnivox_request_queue_time_seconds": "histogram",
        "omnivox_request_prefill_time_seconds": "histogram",
        "omnivox_request_decode_time_seconds": "histogram",
        "omnivox_num_requests_running": "gauge",
        "omnivox_num_requests_waiting": "gauge",
        "omnivox_kv_cache_usage_perc": "gauge",
        "omnivox_prompt_tokens": "counter",
        "omnivox_generation_tokens": "counter",
        "omnivox_prefix_cache_hits": "counter",
        "omnivox_request_success": "counter",
        "omnivox_grpc_requests": "counter",
        "omnivox_time_to_first_audio_seconds": "histogram",
        "omnivox_speech_real_time_factor": "histogram",
        "omnivox_audio_seconds": "counter",
        "omnivox_speech_streams_active": "gauge",
        "omnivox_audio_underruns": "counter",
        "omnivox_codec_decode_seconds": "counter",
    }
    for name, kind in types.items():
        assert f[name].type == kind, name
    tiny = dict(model="tiny")
    assert value(f, "omnivox_time_to_first_token_seconds", "omnivox_time_to_first_token_seconds_count", **tiny) == n
    assert value(f, "omnivox_e2e_request_latency_seconds", "omnivox_e2e_request_latency_seconds_count", **tiny) == n
    assert value(f, "omnivox_request_queue_time_seconds", "omnivox_request_queue_time_seconds_count", **tiny) == n
    # 5 tokens each: 4 gaps each between tokens.
    assert value(f, "omnivox_inter_token_latency_seconds", "omnivox_inter_token_latency_seconds_count", **tiny) == 4 * n
    assert value(f, "omnivox_generation_tokens", "omnivox_generation_tokens_total", **tiny) == outputs == 5 * n
    assert value(f, "omnivox_request_success", "omnivox_request_success_total", finished_reason="length", **tiny) == n
    # The same prompt three times: the 2nd and 3rd hit the prefix cache.
    assert value(f, "omnivox_prefix_cache_hits", "omnivox_prefix_cache_hits_total", **tiny) > 0
    assert value(f, "omnivox_grpc_requests", "omnivox_grpc_requests_total", method="Generate", grpc_code="OK") == n
    assert value(f, "omnivox_num_requests_running", "omnivox_num_requests_running", **tiny) == 0
    assert value(f, "omnivox_kv_cache_usage_perc", "omnivox_kv_cache_usage_perc", **tiny) < 1.0
    sp = dict(model="speech")
    assert value(f, "omnivox_audio_seconds", "omnivox_audio_seconds_total", **sp) == pytest.approx(
        summary.audio_seconds, abs=1e-6
    )
    assert value(f, "omnivox_time_to_first_audio_seconds", "omnivox_time_to_first_audio_seconds_count", **sp) == 1
    assert value(f, "omnivox_speech_real_time_factor", "omnivox_speech_real_time_factor_count", **sp) == 1
    assert value(f, "omnivox_speech_streams_active", "omnivox_speech_streams_active", **sp) == 0
    assert value(f, "omnivox_codec_decode_passes", "omnivox_codec_decode_passes_total", **sp) >= 1
    assert 0 < value(f, "omnivox_codec_decode_seconds", "omnivox_codec_decode_seconds_total", **sp) < 60
    assert value(f, "omnivox_request_success", "omnivox_request_success_total", finished_reason="length", **sp) == 1
    assert value(f, "omnivox_e2e_request_latency_seconds", "omnivox_e2e_request_latency_seconds_count", **sp) == 1
    assert value(f, "omnivox_generation_tokens", "omnivox_generation_tokens_total", **sp) >= summary.audio_tokens

    # Structured logs: one JSON line per RPC, with numbers, never the prompt.
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "omnivox.requests"]
    generate = [x for x in lines if x["method"] == "Generate"]
    assert len(generate) == n and all(x["status"] == "OK" and x["output_tokens"] == 5 for x in generate)
    assert all(x["model"] == "tiny" and x["prompt_tokens"] > 0 and "total_s" in x for x in generate)
    assert [x["method"] for x in lines].count("SynthesizeSpeech") == 1
    assert CANARY not in caplog.text


def test_underruns_agree_with_scripted_send_times() -> None:
    meter = UnderrunMeter(buffer_s=0.2)
    # (arrival, audio seconds): playback starts at 0.1 with 0.2 s buffered; dry at 0.3, then 0.4 after the third.
    assert meter.chunk(0.0, 0.1) == 0.0
    assert meter.chunk(0.1, 0.1) == 0.0  # 0.2 s buffered: playback starts
    assert meter.chunk(0.25, 0.1) == 0.0  # before 0.3: in time
    assert meter.chunk(0.5, 0.1) == pytest.approx(0.1)  # dry at 0.4: 0.1 s of silence, playback resumes at 0.5
    assert meter.chunk(0.55, 0.1) == 0.0  # dry at 0.6 now
    assert meter.chunk(0.9, 0.1) == pytest.approx(0.2)  # dry at 0.7
    assert (meter.count, meter.seconds) == (2, pytest.approx(0.3))

    m = Metrics()
    with SpeechStreamMetrics(m, "speech", received=0.0, buffer_s=0.2) as slo:
        for t, s in [(0.0, 0.1), (0.1, 0.1), (0.25, 0.1), (0.5, 0.1), (0.55, 0.1), (0.9, 0.1)]:
            slo.chunk(s, now=t)
        assert m.registry.get_sample_value("omnivox_speech_streams_active", {"model": "speech"}) == 1
        slo.finish(0.6, now=1.2)
    get = m.registry.get_sample_value
    assert get("omnivox_audio_underruns_total", {"model": "speech"}) == 2
    assert get("omnivox_audio_underrun_seconds_total", {"model": "speech"}) == pytest.approx(0.3)
    assert get("omnivox_speech_real_time_factor_sum", {"model": "speech"}) == pytest.approx(2.0)
    assert get("omnivox_speech_streams_active", {"model": "speech"}) == 0


def test_encoder_cache_counters_come_from_the_cache() -> None:
    class FakeCache:
        hits, misses = 3, 2

    m = Metrics()
    cache = FakeCache()
    m.watch_encoder_cache("vlm", "image", cache)
    m.watch_encoder_cache("vlm", "image", cache)  # once per cache
    get = m.registry.get_sample_value
    assert get("omnivox_encoder_cache_queries_total", {"model": "vlm", "modality": "image"}) == 5
    assert get("omnivox_encoder_cache_hits_total", {"model": "vlm", "modality": "image"}) == 3
    cache.hits += 1
    assert get("omnivox_encoder_cache_hits_total", {"model": "vlm", "modality": "image"}) == 4

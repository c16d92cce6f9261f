"""The grpc.aio server: omnivox services + health + reflection, model loading, graceful shutdown.

Life of a server:
  start()        listen; health NOT_SERVING; models listed but UNAVAILABLE
  load_models()  fetch and build every engine in worker threads; health SERVING when all are ready
  stop(grace)    health NOT_SERVING, new calls UNAVAILABLE, in-flight streams get `grace` seconds to finish,
                 then the engines stop
`run()` strings these together around SIGTERM/SIGINT for the `omnivox serve` command.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnivox.services.calls.speech_call import SpeechCalls
from omnivox.services.grpc_api.auth import AuthInterceptor, Quota
from omnivox.services.grpc_api.bindings import omnivox_services
from omnivox.services.grpc_api.health import HealthServicer
from omnivox.services.grpc_api.interceptors import server_interceptors
from omnivox.services.grpc_api.reflection import enable_reflection
from omnivox.services.grpc_api.tls import CertificateFiles
from omnivox.services.limits import GrpcLimits
from omnivox.services.metrics import Metrics
from omnivox.services.parts import loading
from omnivox.services.parts.loading import EngineOptions, ModelLoadError, ModelSpec
from omnivox.services.parts.registry import ModelRegistry, ModelState, ServedModel
from omnivox.services.processing.audio_prompt import log_message_limit
from omnivox.services.processing.stream_idle import DEFAULT_STREAM_IDLE_S

log = logging.getLogger(__name__)

MiB = 1 << 20
ENGINE_FAILED_EXIT = 3  # `omnivox serve` exit status after an engine failure


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port (see OmnivoxServer.port after start)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_receive_message_bytes: int = 64 * MiB  # images and audio arrive inline
    max_queue: int = 256  # requests admitted at once per model (waiting + running)
    grace_period_s: float = 30.0  # how long in-flight streams may run on after SIGTERM
    metrics_port: int | None = None  # HTTP /metrics (Prometheus) on host:port; None = not served; 0 = any free port
    # Plaintext grpc.health.v1 alone on host:port, for probes that cannot speak TLS or mTLS (the kubelet's gRPC
    # probes, Docker's HEALTHCHECK) when `port` has them; None = not served; 0 = any free port.
    health_port: int | None = None
    api_keys: Path | None = None  # one key per line (or id:key): omnivox RPCs then need `authorization: Bearer KEY`
    tls_client_ca: Path | None = None  # mTLS: client certificates signed by this CA are required
    quota: Quota = Quota()  # per caller (API key id / certificate name)
    limits: GrpcLimits = GrpcLimits()
    trace_exporter: Any = None  # an OpenTelemetry SpanExporter: tracing on (services/grpc_api/tracing.py); None = off
    data_dir: Path | None = None  # created voices live here (services/parts/voices.py); None = $OMNIVOX_DATA_DIR or XDG
    # A served Whisper model: Generate's audio for text models (services/processing/cascade.py); "auto": the first one when
    # others are served beside it; None: off.
    asr_model: str | None = "auto"
    # A speech stream whose client runs dry within this many seconds steps first (engine/arbiter.py); 0 = off.
    audio_first_margin_s: float = 1.0
    stream_idle_timeout_s: float = DEFAULT_STREAM_IDLE_S  # bidirectional streams idle this long end (0 = never)
    http_port: int | None = None  # the OpenAI-compatible HTTP front on host:port; None = not served; 0 = any free port
    realtime_limits: Any = None  # RealtimeLimits of GET /v1/realtime (services/openai_api/realtime/limits.py)


def listen_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


class OmnivoxServer:
    def __init__(self, registry: ModelRegistry, options: ServerOptions = ServerOptions()) -> None:
        self.registry = registry
        self.options = options
        registry.set_asr_model(options.asr_model)  # ModelLoadError unless it names a served Whisper model
        registry.stream_idle_s = options.stream_idle_timeout_s or None
        registry.arbiter.margin_s = options.audio_first_margin_s
        self.health = HealthServicer()
        self.metrics = Metrics()
        self.metrics_port: int | None = None
        self.services = omnivox_services(registry, self.metrics, options.data_dir)
        self.port: int | None = None
        self.engine_failed = asyncio.Event()  # crash-only: set when an engine's step loop raised
        self.tracing: Any = None
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        self.http: Any = None  # the HTTP front (services/openai_api/http_front.py) when http_port is set
        self.http_port: int | None = None
        self._force_stop = asyncio.Event()
        self.forced = False  # a drain cut short by force_stop()

    @property
    def address(self) -> str:
        """Where a client on this machine connects."""
        assert self.port is not None, "start() first"
        host = self.options.host
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"
        return listen_address(host, self.port)

    @property
    def service_names(self) -> list[str]:
        return [s.full_name for s in self.services]

    async def start(self) -> int:
        """Listen and serve health, reflection and ListModels; return the port. Models are not loaded yet."""
        opts = self.options
        interceptors, self.tracing = server_interceptors(self.metrics, opts)  # calls, tracing, auth
        self._server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", opts.max_receive_message_bytes),
                ("grpc.max_send_message_length", opts.max_receive_message_bytes),
                ("grpc.so_reuseport", 0),  # a second server on the same port is an error, not a silent share
                *opts.limits.channel_options(),
            ],
        )
        for binding in self.services:
            binding.add_to_server(binding.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        enable_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], self._server
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

        address = listen_address(opts.host, opts.port)
        try:
            if opts.tls_cert or opts.tls_key:
                if not (opts.tls_cert and opts.tls_key):
                    raise ValueError("TLS needs both a certificate and a key")
                # Re-read when the files change (services/grpc_api/tls.py): renewed certificates need no restart.
                files = CertificateFiles(opts.tls_cert, opts.tls_key, opts.tls_client_ca)
                self.port = self._server.add_secure_port(address, files.credentials())
            elif opts.tls_client_ca:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            else:
                self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {address}: {exc}") from exc
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        await self._server.start()
        log.info("listening on %s%s", listen_address(opts.host, self.port), " (TLS)" if opts.tls_cert else "")
        if opts.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve(opts.metrics_port, opts.host)
            except OSError as exc:  # stop the started gRPC server here: left to the GC, it printed a traceback at exit
                await self._server.stop(0)
                address = listen_address(opts.host, opts.metrics_port)
                raise OSError(f"cannot serve metrics on {address}: {exc.strerror or exc}") from exc
            log.info("metrics on http://%s/metrics", listen_address(opts.host, self.metrics_port))
        if opts.health_port is not None:
            await self._serve_health(opts.host, opts.health_port)
        if opts.http_port is not None:
            await self._serve_http(opts, interceptors)
        return self.port

    async def _serve_http(self, opts: ServerOptions, interceptors: list[Any]) -> None:
        """The OpenAI-compatible front, with the gRPC chain's keys and quotas (one book for both fronts)."""
        from omnivox.services.openai_api.http_front import (
            HttpFront,  # FastAPI and uvicorn are imported only when asked for
        )
        from omnivox.services.openai_api.http_speech import SpeechRoutes
        from omnivox.services.openai_api.http_transcription import TranscriptionRoutes

        auth = next((i for i in interceptors if isinstance(i, AuthInterceptor)), None)
        self.http = HttpFront(self.registry, self.metrics, auth, opts.max_receive_message_bytes, opts.realtime_limits)
        speech = next(
            (c for b in self.services if isinstance(c := getattr(b.servicer, "calls", None), SpeechCalls)), None
        )
        if speech is not None:  # the gRPC SpeechService's own processing: one set of limits and created voices
            SpeechRoutes(self.http, speech)
        TranscriptionRoutes(self.http, self.registry, self.metrics)  # Transcribe's processing (transcribe_call.py)
        ssl: dict[str, Any] = (
            {"ssl_certfile": str(opts.tls_cert), "ssl_keyfile": str(opts.tls_key)} if opts.tls_cert else {}
        )
        if opts.tls_client_ca:  # mTLS as on the gRPC port: no client certificate, no handshake
            import ssl as ssl_module

            ssl.update(ssl_ca_certs=str(opts.tls_client_ca), ssl_cert_reqs=ssl_module.CERT_REQUIRED)
        try:
            self.http_port = await self.http.start(opts.host, opts.http_port, ssl)
        except (OSError, SystemExit) as exc:  # uvicorn logs the bind error and exits its startup
            assert self._server is not None
            await self._server.stop(0)
            self.metrics.close()
            raise OSError(f"cannot serve HTTP on {listen_address(opts.host, opts.http_port)}") from exc
        scheme = "https" if opts.tls_cert else "http"
        log.info("OpenAI-compatible HTTP on %s://%s/v1", scheme, listen_address(opts.host, self.http_port))

    async def _serve_health(self, host: str, port: int) -> None:
        """The health service (the same servicer: the same statuses and Watch updates) alone, in plaintext."""
        self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        address = listen_address(host, port)
        try:
            self.health_port = self._health_server.add_insecure_port(address)
        except RuntimeError:
            self.health_port = 0
        if not self.health_port:
            assert self._server is not None
            await self._server.stop(0)
            self.metrics.close()
            raise OSError(f"cannot serve health checks on {address}")
        await self._health_server.start()
        log.info("health checks (plaintext) on %s", listen_address(host, self.health_port))

    async def _set_health(self, status: int) -> None:
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def load_models(self, options: EngineOptions) -> None:
        """Load every LOADING model in a worker thread, one after another; SERVING once all are ready.

        A model that fails to load, when others are served, leaves them serving: ListModels reports it not ready,
        health says NOT_SERVING for `model/NAME`, and its requests get FAILED_PRECONDITION. Health "" (the whole
        server, what orchestrators probe) stays NOT_SERVING while any configured model is not loaded, so a replica
        short of a model gets no traffic and its startup probe restarts it; the omnivox services' names say SERVING
        for the models that are. When every model fails (a single one, say) the first ModelLoadError is raised.
        """
        failures: list[ModelLoadError] = []
        for model in self.registry:
            if model.bundle is None and model.state is not ModelState.FAILED:
                log.info("loading %s from %s", model.name, model.source or "the embedded default")
                try:
                    await asyncio.to_thread(loading.load, model, options)  # the whole bundle, speech codec included
                except ModelLoadError as err:
                    failures.append(err)
                    log.error("%s; the other models keep serving", err)
                    await self.health.set(f"model/{model.name}", health_pb2.HealthCheckResponse.NOT_SERVING)
                    continue
                log.info("%s ready (context %d tokens)", model.name, model.context_length)
                log_message_limit(model, self.options.max_receive_message_bytes)
            if model.engine is not None:
                self._watch_engine(model)
            if model.bundle is not None:  # a voice has no engine to watch (services/parts/voice_part.py)
                await self.health.set(f"model/{model.name}", health_pb2.HealthCheckResponse.SERVING)
        if failures and len(failures) == len(self.registry):
            raise failures[0]
        if not self.registry.draining:
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            if failures:
                await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                log.error('health "" NOT_SERVING: %d of %d models failed to load', len(failures), len(self.registry))

    def _watch_engine(self, model: ServedModel) -> None:
        """Metrics from every step; and crash-only: a failed step loop makes health NOT_SERVING and ends the server
        (`run` exits non-zero) instead of leaving a live server that answers nothing."""
        engine = model.engine
        assert engine is not None
        self.metrics.attach(model.name, engine)
        engine.arbiter = self.registry.arbiter
        self.metrics.watch_arbiter(model.name, engine, self.registry.arbiter)
        for modality, part in (("audio", model.bundle.audio), ("image", model.bundle.vision)) if model.bundle else ():
            if part is not None:
                self.metrics.watch_encoder_cache(model.name, modality, part.worker.cache)
        if model.bundle is not None and model.bundle.speech is not None:
            self.metrics.watch_codec(model.name, model.bundle.speech.worker)
        loop = asyncio.get_running_loop()

        def failed(exc: Exception) -> None:  # on the engine thread
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._on_engine_failure(model, exc)))

        if not engine.failure_observers:
            engine.failure_observers.append(failed)

    async def _on_engine_failure(self, model: ServedModel, exc: Exception) -> None:
        log.critical("the engine of %s failed (%r): NOT_SERVING, shutting down", model.name, exc)
        model.set_failed(f"the engine failed: {exc!r}")
        await self.health.set(f"model/{model.name}", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.engine_failed.set()

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: NOT_SERVING, refuse new calls, let in-flight calls finish within the grace period; stop engines."""
        grace = self.options.grace_period_s if grace_s is None else grace_s
        deadline = asyncio.get_running_loop().time() + grace
        self.registry.draining = True
        await self.health.enter_graceful_shutdown()
        # While requests run, the server still answers: health checks say NOT_SERVING, new calls get UNAVAILABLE.
        while self.registry.in_flight() and asyncio.get_running_loop().time() < deadline:
            if self._force_stop.is_set():
                break
            await asyncio.sleep(0.02)
        if self._server is not None:
            # Then close. Long-lived calls that never end on their own (health Watch streams) get a short grace;
            # calls still running are cancelled, which aborts their engine requests.
            remaining = max(deadline - asyncio.get_running_loop().time(), 0.0)
            await self._server.stop(0 if self._force_stop.is_set() else min(remaining, 1.0))
        if self.http is not None:  # its streams still running are cancelled: their engine requests abort
            await self.http.stop()
        if self._health_server is not None:  # after the main port: probes saw NOT_SERVING through the drain
            await self._health_server.stop(0)
        await self.registry.aclose()  # every bundle: its codec worker, then its engine
        self.metrics.close()
        if self.tracing is not None:
            self.tracing.shutdown()  # flushes the spans still batched

    def serving_line(self) -> str:
        """What start-up ends with: the models that serve, and those that failed to load (said once above each)."""
        ready = [m.name for m in self.registry if m.state is not ModelState.FAILED]
        failed = [m.name for m in self.registry if m.state is ModelState.FAILED]
        line = f"serving {', '.join(ready)} on {self.address}"
        return f"{line}; not serving {', '.join(failed)} (failed to load)" if failed else line

    def force_stop(self) -> None:
        """Cut a drain short: in-flight calls are cancelled now instead of finishing."""
        self.forced = True
        self._force_stop.set()

    async def wait_for_termination(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()


def build_registry(specs: Sequence[ModelSpec], max_queue: int) -> ModelRegistry:
    """Check every spec's path (ModelLoadError names the bad one) and register them; the first is the default."""
    registry = ModelRegistry()
    for i, spec in enumerate(specs):
        try:
            registry.add(loading.resolve(spec, is_default=i == 0, max_queue=max_queue))
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
    return registry


async def run(
    specs: Sequence[ModelSpec],
    options: ServerOptions,
    engine_options: EngineOptions,
    on_ready: Callable[[OmnivoxServer], Awaitable[None]] | None = None,
) -> int:
    """Serve until SIGTERM or SIGINT, then drain and return 0 (1 when a second signal cut the drain short); return
    ENGINE_FAILED_EXIT within seconds when an engine's step loop failed (crash-only: let the supervisor restart us).

    Raises ModelLoadError / OSError for the CLI to print.
    """
    registry = build_registry(specs, options.max_queue)
    server = OmnivoxServer(registry, options)
    await server.start()

    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stop_requested, server)
    try:
        load = asyncio.create_task(server.load_models(engine_options))
        stop_wait = asyncio.create_task(stop_requested.wait())
        await asyncio.wait([load, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        if load.done() and load.exception() is not None:
            await server.stop(0)
            raise load.exception()  # type: ignore[misc]
        if not stop_requested.is_set():
            log.info("%s", server.serving_line())
            demo = asyncio.create_task(on_ready(server)) if on_ready is not None else None
            crash_wait = asyncio.create_task(server.engine_failed.wait())
            await asyncio.wait([stop_wait, crash_wait], return_when=asyncio.FIRST_COMPLETED)
            crash_wait.cancel()
            if demo is not None and not demo.done():
                demo.cancel()
        if server.engine_failed.is_set():
            await server.stop(1.0)  # the failed engine's calls already ended with INTERNAL; the others get 1 s
            log.critical("stopped after an engine failure")
            gc.freeze()  # the process exits next: see below
            return ENGINE_FAILED_EXIT
        log.info(
            "shutting down: %d in-flight requests have %.0f s to finish", registry.in_flight(), options.grace_period_s
        )
        await server.stop()
        if not load.done():
            load.cancel()
        log.info("stopped")
        # The process exits next. Frozen, the heap (torch, transformers, the model: 0.4M objects from the imports alone)
        # is left out of the interpreter's final collection, which took 2.1-3.9 s after this line (SIGTERM to exit
        # 2.5-4.4 s idle at load 4.6-6.3; 0.7-1.5 s frozen); the OS frees the memory either way.
        gc.freeze()
        return 1 if server.forced else 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def _on_signal(sig: signal.Signals, stop_requested: asyncio.Event, server: OmnivoxServer) -> None:
    if stop_requested.is_set():
        log.warning("%s again: cancelling the requests still running", sig.name)
        server.force_stop()
        return
    log.info("%s received", sig.name)
    stop_requested.set()

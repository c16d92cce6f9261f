"""One encoder cache and one encoder worker, shared by every image and audio input of a model.

The cache holds encoded features ([num_tokens, hidden]) by segment key (a hash of the raw input, the preprocessing
settings and the model). Entries are reference-counted by the requests using them; an unreferenced entry stays until
the byte budget needs its room (least recently used first). Features still referenced are never evicted, even when
they exceed the budget for a while (the service refuses a single input larger than the budget at admission).

The worker is one thread that encodes what is asked for, in batches: everything queued when it wakes goes through
`encode_batch` in one call (one forward pass over the images or clips of all requests admitted together). The same
key asked for twice while in flight is encoded once; a batch that fails is retried one input at a time, so one bad
input fails only its own request. The engine thread never waits for it: a prefill chunk stops
short of a segment that is not ready (engine/scheduler.py), and the other requests' steps go on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

# Encodes a batch of preprocessed inputs into one feature tensor [num_tokens, hidden] each, in order.
EncodeBatch = Callable[[Sequence[Any]], Sequence[torch.Tensor]]


@dataclass
class _Entry:
    key: str
    payload: Any = None  # the preprocessed input, until it is queued for encoding
    queued: bool = False
    features: torch.Tensor | None = None
    error: BaseException | None = None
    refs: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    encoded: tuple[float, float] | None = None  # time.monotonic() start and end of its encoder pass (tracing)

    @property
    def nbytes(self) -> int:
        f = self.features
        return 0 if f is None else f.numel() * f.element_size()


def salted_key(key: str, salt: str) -> str:
    """The cache entry's name for content `key` under `salt` (`key` itself for the shared, unsalted entry)."""
    return f"{key}|salt:{salt}" if salt else key


class EncoderCache:
    """Features by key, reference-counted, LRU-evicted under `budget_bytes` (thread-safe)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # front = least recently used
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def refs(self, key: str) -> int:
        with self._lock:
            e = self._entries.get(key)
            return 0 if e is None else e.refs

    def total_refs(self) -> int:
        with self._lock:
            return sum(e.refs for e in self._entries.values())

    def __contains__(self, key: str) -> bool:
        with self._lock:
            e = self._entries.get(key)
            return e is not None and e.done.is_set() and e.error is None

    def _acquire(self, key: str, payload: Any) -> _Entry:
        """The entry for key with one more reference (a new one, holding payload, if the cache lacks it)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.error is not None:  # a failed entry is tried again
                e = _Entry(key, payload)
                self._entries[key] = e
                self.misses += 1
            else:
                self.hits += 1
            self._entries.move_to_end(key)
            e.refs += 1
            return e

    def _take_payload(self, e: _Entry) -> tuple[bool, Any]:
        """(True, payload) for the first caller that asks for e's encoding; (False, None) after that."""
        with self._lock:
            if e.queued or e.done.is_set():
                return False, None
            e.queued, payload, e.payload = True, e.payload, None
            return True, payload

    def _release(self, e: _Entry) -> None:
        with self._lock:
            assert e.refs > 0, f"encoder cache entry {e.key} released twice"
            e.refs -= 1
            if e.refs == 0 and not e.queued and not e.done.is_set() and self._entries.get(e.key) is e:
                del self._entries[e.key]  # nobody asked for its encoding and nobody holds it: forget it
            self._evict()

    def _fill(self, e: _Entry, features: torch.Tensor | None, error: BaseException | None) -> None:
        with self._lock:
            e.features, e.error = features, error
            if error is not None and e.refs == 0 and self._entries.get(e.key) is e:
                del self._entries[e.key]
            self._evict()
        e.done.set()

    def _evict(self) -> None:  # under the lock
        total = sum(x.nbytes for x in self._entries.values())
        for key in list(self._entries):
            if total <= self.budget_bytes:
                break
            e = self._entries[key]
            if e.refs == 0 and e.done.is_set():
                total -= e.nbytes
                del self._entries[key]
                self.evictions += 1


class EncodeHandle:
    """One request's reference to one encoded input: the engine's EmbeddingSource."""

    def __init__(self, worker: EncoderWorker, entry: _Entry) -> None:
        self._worker, self._entry = worker, entry
        self._released = False

    def start(self) -> None:
        take, payload = self._worker.cache._take_payload(self._entry)
        if take:
            self._worker._enqueue(self._entry, payload)

    def ready(self) -> bool:
        return self._entry.done.is_set() and self._entry.error is None

    def failed(self) -> bool:
        return self._entry.done.is_set() and self._entry.error is not None

    def result(self) -> torch.Tensor:
        self.start()
        self._entry.done.wait()
        if self._entry.error is not None:
            raise RuntimeError(f"encoding {self._entry.key} failed: {self._entry.error}") from self._entry.error
        assert self._entry.features is not None
        return self._entry.features

    @property
    def encoded(self) -> tuple[float, float] | None:
        """When its encoder pass ran (time.monotonic() start, end); None for a cache hit encoded before."""
        return self._entry.encoded

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._worker.cache._release(self._entry)


class EncoderWorker:
    """The thread that runs `encode_batch` over everything queued, at most `max_batch` inputs per call."""

    def __init__(
        self,
        encode_batch: EncodeBatch,
        cache: EncoderCache,
        max_batch: int = 16,
        name: str = "encoder",
        device: torch.device | str | None = None,
    ):
        """device: where the encoder runs; on CUDA the thread makes it its current device (`--device cuda:1`: kernels
        and allocations that name no device would otherwise go to cuda:0, as the engine thread's would)."""
        self.device = torch.device(device) if device is not None else None
        self.encode_batch = encode_batch
        self.cache = cache
        self.max_batch = max_batch
        self._queue: list[tuple[_Entry, Any]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.num_batches = 0
        self.num_encoded = 0
        self._thread = threading.Thread(target=self._loop, name=f"omnivox-{name}", daemon=True)
        self._thread.start()

    def handle(self, key: str, payload: Any, salt: str = "") -> EncodeHandle:
        """A reference to key's features; `payload` (the preprocessed input) is encoded only if the cache lacks them,
        and only once `start()` is called (admission, unless the prefix cache covers the segment).

        `salt`: only handles with the same salt share an entry (or an encoding in flight), as only requests with the
        same cache salt share prefix-cache blocks (engine/kv_manager.py): a tenant must not learn from a fast answer
        that another one sent this image or clip. "" is the shared entry, named by `key` alone."""
        return EncodeHandle(self, self.cache._acquire(salted_key(key, salt), payload))

    def _enqueue(self, entry: _Entry, payload: Any) -> None:
        with self._cond:
            self._queue.append((entry, payload))
            self._cond.notify()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    pending, self._queue = self._queue, []
                    for entry, _ in pending:
                        self.cache._fill(entry, None, RuntimeError("the encoder worker stopped"))
                    return
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            self._encode(batch)

    def _encode(self, batch: list[tuple[_Entry, Any]]) -> None:
        started = time.monotonic()
        try:
            with torch.inference_mode():
                features = list(self.encode_batch([payload for _, payload in batch]))
            if len(features) != len(batch):
                raise RuntimeError(f"encoder returned {len(features)} results for {len(batch)} inputs")
        except Exception as exc:
            if len(batch) > 1:  # one bad input must not fail the others: encode them one by one
                log.warning("a batch of %d inputs failed (%s); encoding them one at a time", len(batch), exc)
                for item in batch:
                    self._encode([item])
                return
            log.exception("encoding %s failed", batch[0][0].key)
            self.cache._fill(batch[0][0], None, exc)
            return
        self.num_batches += 1
        self.num_encoded += len(batch)
        ended = time.monotonic()
        for (entry, _), f in zip(batch, features, strict=True):
            entry.encoded = (started, ended)
            self.cache._fill(entry, f.detach(), None)

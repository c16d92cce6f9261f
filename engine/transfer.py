"""Host <-> device traffic of a step without stream syncs: small host lists go up through pinned memory with
non-blocking copies, and everything the host needs back comes down in one copy.

Why: on CUDA `torch.tensor(x, device="cuda")` and `.tolist()` each wait for the stream, i.e. for the whole forward
pass and every kernel queued after it; a sampler that makes ten of them per step pays ten round trips and keeps the
GPU idle while the host builds the next launch. vLLM's sampler and input batch use the same two tricks.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list (or CPU tensor) on `device` without a stream sync. `torch.tensor(x, device="cuda")` copies from
    pageable memory and waits for the stream (here: for the whole forward pass) on every call; through pinned memory
    the copy is queued behind the kernels and the host runs on. On CPU this is `torch.tensor(values)`."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if t.device.type != "cpu" or device.type != "cuda":
        return t.to(device)  # a no-op where it already is (CPU here)
    return t.pin_memory().to(device, non_blocking=True)


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows]: t itself when rows is all of t in order (the caller owns t), else a copy (index sent without a sync)."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, to_device(rows, t.device, torch.long))


class HostTransfer:
    """Everything the host needs from a step, in one device-to-host copy: the parts are packed into one float64
    tensor (token ids and float32 logprobs are exact in it), copied into a persistent pinned buffer with a
    non-blocking copy, and waited for with an event. On CPU the packed tensor is read directly."""

    def __init__(self) -> None:
        self._pinned: torch.Tensor | None = None  # float64, grown to the largest step seen (CUDA only)
        self.num_copies = 0  # device-to-host copies made (tests count them)

    def __call__(self, parts: list[torch.Tensor]) -> list[float]:
        if not parts:
            return []
        flat = torch.cat([p.reshape(-1).to(torch.float64) for p in parts])  # [N]
        self.num_copies += 1
        if flat.device.type != "cuda":
            return flat.tolist()
        n = flat.numel()
        if self._pinned is None or self._pinned.numel() < n:
            size = n if self._pinned is None else max(n, 2 * self._pinned.numel())
            self._pinned = torch.empty(size, dtype=torch.float64, pin_memory=True)
        host = self._pinned[:n]
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(flat.device))
        done.synchronize()  # the only wait of the step: for the sampler's last kernel and this copy
        return host.tolist()


class DeviceStaging:
    """The small int64 tensors of a step (token ids, positions, KV slots, block tables, lengths, row indices) sent to
    the device in one copy: packed on the host into one buffer (persistent and pinned on CUDA), copied with a single
    non-blocking copy, and handed back as views of one device tensor, each in its original shape. A step built from
    eight separate tensors would make eight copies (vLLM's input batch and nano-vllm's `prepare_*` keep the same
    one-buffer habit). `pack` defaults to on for CUDA only: on the CPU there is no copy to save, and views of one
    buffer would cost elsewhere (a tensor-parallel step pickles each view with its whole buffer). The CPU tests pack
    with pack=True, where the packed tensor is split directly."""

    def __init__(self, device: torch.device, pack: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pack = self.device.type == "cuda" if pack is None else pack
        self._pinned: torch.Tensor | None = None  # int64, grown to the largest step seen (CUDA only)
        self._copied: torch.cuda.Event | None = None  # the last copy out of the pinned buffer (it is reused)
        self.num_copies = 0  # packed copies made (tests count them)

    def __call__(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        for p in parts:
            if p.dtype != torch.long or p.device.type != "cpu":
                raise TypeError(f"staging takes int64 host tensors, got {p.dtype} on {p.device}")
        if not self.pack:  # one copy per part (none on the CPU)
            return [p.to(self.device) for p in parts]
        if not parts:
            return []
        sizes = [p.numel() for p in parts]
        flats = [p.reshape(-1) for p in parts]
        self.num_copies += 1
        if self.device.type != "cuda":
            flat = torch.cat(flats)
        else:
            n = sum(sizes)
            if self._copied is not None:
                self._copied.synchronize()  # queued before the previous forward pass: long done in the steady state
            if self._pinned is None or self._pinned.numel() < n:
                size = n if self._pinned is None else max(n, 2 * self._pinned.numel())
                self._pinned = torch.empty(size, dtype=torch.long, pin_memory=True)
            host = self._pinned[:n]
            torch.cat(flats, out=host)
            flat = torch.empty(n, dtype=torch.long, device=self.device)
            flat.copy_(host, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        return [v.view(p.shape) for v, p in zip(flat.split(sizes), parts, strict=True)]

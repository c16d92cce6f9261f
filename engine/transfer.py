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

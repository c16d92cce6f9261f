"""Building a module on the meta device without paying for the random init of weights that hold no values.

Under plain `torch.device("meta")` every nn.init fill of a new parameter (Embedding's normal_, Linear's
kaiming_uniform_ -> uniform_) runs torch's Python reference implementation, and the first such call imports
torch._dynamo: 1-1.5 s of every `omnivox serve` start, for fills of tensors that hold no data. `meta_device()` is
`torch.device("meta")` with those fills skipped on meta tensors; everything else runs as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

# nn.init's fills (each dispatches its tensor through torch functions modes first) and the tensor methods they end in:
# on a meta tensor each is a no-op by definition.
_INIT = ("normal_", "uniform_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_", "kaiming_normal_")
_INIT += ("xavier_uniform_", "xavier_normal_", "orthogonal_")
_FILLS = frozenset(
    {*(getattr(torch.nn.init, n) for n in _INIT), torch.Tensor.normal_, torch.Tensor.uniform_}
    | {torch.Tensor.zero_, torch.Tensor.fill_}
)


class _SkipMetaFills(TorchFunctionMode):
    """Thread-local (torch function modes are per thread): a model loading in another thread is untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FILLS:
            tensor = args[0] if args else kwargs.get("tensor")  # nn.init passes its tensor by keyword
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """`with meta_device(): model = Module(...)`: as `with torch.device("meta")`, minus the init fills."""
    with torch.device("meta"), _SkipMetaFills():
        yield

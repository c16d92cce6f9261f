"""The layers of Mimi's decoder, each streaming: a chunk of frames in, its audio out, carried state in between.

Mimi (kyutai/mimi, transformers' `MimiModel`) is causal end to end: causal convolutions (left padding only), transposed
convolutions trimmed on the right, and a causal transformer with a sliding attention window. So, unlike SNAC's
windowed re-decode (codecs/streaming.py), a stream can be decoded exactly chunk by chunk if each layer keeps what the
next chunk needs, as moshi's `StreamingModule`s do:

- `StreamingConv1d` keeps the last `(kernel - 1) * dilation` input steps (zeros at the start: the one-shot decode's
  constant left padding);
- `StreamingConvTranspose1d` keeps the `kernel - stride` output steps that the next input's taps still add to (the
  one-shot decode trims those on the right, so they are not audio yet);
- `StreamingAttention` keeps a ring of the last `sliding_window` rotated keys and values with their positions.

Each module's state is a dict of batch-first tensors (`init_state`), updated by `forward(x, state)`; a stream's
state is the list of its modules' dicts (codecs/mimi.py `MimiDecodeState`), so states of several streams stack into
one batch and split back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

State = dict[str, torch.Tensor]


class StreamingConv1d(nn.Module):
    """transformers' causal `MimiConv1d` with stride 1 (every conv of Mimi's decoder): left context from the state."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation)
        self.context = (kernel_size - 1) * dilation  # the one-shot decode's left padding

    def init_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> State:
        return {"tail": torch.zeros(batch, self.conv.in_channels, self.context, device=device, dtype=dtype)}

    def forward(self, x: torch.Tensor, state: State) -> torch.Tensor:  # x: (B x C_in x T) -> (B x C_out x T)
        if self.context:
            x = torch.cat([state["tail"], x], dim=-1)
            state["tail"] = x[..., x.shape[-1] - self.context :]
        return self.conv(x)


class StreamingConvTranspose1d(nn.Module):
    """transformers' causal `MimiConvTranspose1d` (trim_right_ratio 1): the trimmed right overlap carried over."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, stride: int, groups: int = 1, bias: bool = True
    ) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride, groups=groups, bias=bias)
        self.stride = stride
        self.overlap = kernel_size - stride
        if self.overlap > stride:  # the carried overlap must fit in one input step's output
            raise ValueError(f"kernel {kernel_size} > 2 x stride {stride} is not a Mimi layer")

    def init_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> State:
        return {"partial": torch.zeros(batch, self.conv.out_channels, self.overlap, device=device, dtype=dtype)}

    def forward(self, x: torch.Tensor, state: State) -> torch.Tensor:  # x: (B x C_in x T) -> (B x C_out x T*stride)
        y = F.conv_transpose1d(x, self.conv.weight, None, self.stride, groups=self.conv.groups)  # (T-1)*s + k steps
        emit = x.shape[-1] * self.stride
        if self.overlap:
            y[..., : self.overlap] += state["partial"]
            state["partial"] = y[..., emit:].clone()
        y = y[..., :emit]
        return y if self.conv.bias is None else y + self.conv.bias[:, None]


class ResnetBlock(nn.Module):
    """transformers' `MimiResnetBlock`: ELU, conv (dilated), ELU, conv 1x1, plus the input (or its 1x1 conv)."""

    def __init__(self, dim: int, hidden: int, kernel_size: int, dilation: int, conv_shortcut: bool) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [nn.ELU(), StreamingConv1d(dim, hidden, kernel_size, dilation), nn.ELU(), StreamingConv1d(hidden, dim, 1)]
        )
        self.shortcut = StreamingConv1d(dim, dim, 1) if conv_shortcut else None

    def streaming_modules(self) -> list[nn.Module]:
        return [self.block[1], self.block[3]] + ([self.shortcut] if self.shortcut is not None else [])

    def forward(self, x: torch.Tensor, states: list[State]) -> torch.Tensor:  # (B x C x T)
        h = self.block[1](self.block[0](x), states[0])
        h = self.block[3](self.block[2](h), states[1])
        residual = x if self.shortcut is None else self.shortcut(x, states[2])
        return residual + h


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StreamingAttention(nn.Module):
    """transformers' `MimiAttention` (RoPE, causal, sliding window) over a ring of the window's past keys/values."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, window: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)

    def init_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> State:
        ring = (batch, self.kv_heads, self.window, self.head_dim)
        return {
            "keys": torch.zeros(ring, device=device, dtype=dtype),
            "values": torch.zeros(ring, device=device, dtype=dtype),
            "positions": torch.full((batch, self.window), -1, device=device, dtype=torch.int64),  # -1: empty slot
        }

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: State
    ) -> torch.Tensor:
        """x (B x T x hidden); positions (B x T) absolute; cos/sin (B x 1 x T x head_dim) -> (B x T x hidden)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (B x H x T x D)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # (B x H_kv x T x D)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys = torch.cat([state["keys"], k], dim=2)  # (B x H_kv x W+T x D)
        values = torch.cat([state["values"], v], dim=2)
        key_pos = torch.cat([state["positions"], positions], dim=1)[:, None, :]  # (B x 1 x W+T)
        query_pos = positions[:, :, None]  # (B x T x 1)
        # transformers' sliding-window causal mask: a query sees the `window` positions ending at its own
        allowed = (key_pos >= 0) & (key_pos <= query_pos) & (query_pos - key_pos < self.window)  # (B x T x W+T)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=allowed[:, None], enable_gqa=self.heads != self.kv_heads
        )  # (B x H x T x D)
        n = min(t, self.window)  # only the last `window` new steps can be seen again
        slots = positions[:, t - n :] % self.window  # (B x n)
        index = slots[:, None, :, None].expand(b, self.kv_heads, n, self.head_dim)
        state["keys"] = state["keys"].scatter(2, index, k[:, :, t - n :])
        state["values"] = state["values"].scatter(2, index, v[:, :, t - n :])
        state["positions"] = state["positions"].scatter(1, slots, positions[:, t - n :])
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class LayerScale(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act not in ("gelu", "gelu_pytorch_tanh", "gelu_new"):
            raise ValueError(f"Mimi hidden_act {act!r} is not supported")
        self.approximate = "none" if act == "gelu" else "tanh"
        self.fc1 = nn.Linear(hidden, intermediate, bias=False)
        self.fc2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class TransformerLayer(nn.Module):
    """transformers' `MimiTransformerLayer`: pre-LayerNorm attention and MLP, each scaled before the residual add."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.self_attn = StreamingAttention(
            hidden,
            config["num_attention_heads"],
            config["num_key_value_heads"],
            config["head_dim"],
            config["sliding_window"],
            config["attention_bias"],
        )
        self.mlp = MLP(hidden, config["intermediate_size"], config["hidden_act"])
        self.input_layernorm = nn.LayerNorm(hidden, eps=config["norm_eps"])
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=config["norm_eps"])
        self.self_attn_layer_scale = LayerScale(hidden)
        self.mlp_layer_scale = LayerScale(hidden)

    def forward(self, x, positions, cos, sin, state: State) -> torch.Tensor:  # x: (B x T x hidden)
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), positions, cos, sin, state))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class DecoderTransformer(nn.Module):
    """transformers' `MimiTransformerModel` for the decoder, positions per stream (streams at different offsets)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(config) for _ in range(config["num_hidden_layers"])])
        dim = config["head_dim"]
        theta = float(config["rope_theta"])
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, start: torch.Tensor, states: list[State]) -> torch.Tensor:
        """x (B x T x hidden), start (B,) int64: each row's first absolute position."""
        positions = start[:, None] + torch.arange(x.shape[1], device=x.device)  # (B x T)
        freqs = positions[..., None].float() * self.inv_freq  # (B x T x D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B x 1 x T x D)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer, state in zip(self.layers, states, strict=True):
            x = layer(x, positions, cos, sin, state)
        return x

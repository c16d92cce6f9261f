"""Executes one SchedulePlan: builds the flattened batch and attention metadata, runs the decoder, returns logits.

It owns the KV cache tensors (one flat K and V tensor per layer). Everything per step is built once and shared by
all layers; the model itself runs as one batched forward pass for all decodes and prefill chunks together.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext as _nullcontext

import torch

from omnivox.engine.scheduler import ScheduledChunk, SchedulePlan
from omnivox.engine.static_decode import StaticDecoder
from omnivox.engine.transfer import DeviceStaging
from omnivox.models.attention import (
    AttentionMetadata,
    PrefillChunk,
    decode_attention_flex,
    paged_block_mask,
    sdpa_backend_name,
)
from omnivox.models.decoder import DecoderModel

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        device,
        dtype,
        max_num_seqs: int = 64,
        static_decode: bool | None = None,
        decode_attention: str | None = None,
    ) -> None:
        """static_decode: pad decode-only steps to fixed shapes (CUDA graphs on a GPU); None = on CUDA only.
        decode_attention: "flex" (read the paged cache in place; None = on CUDA) or "native" (the CPU C kernel, else
        the gathered SDPA path). A flex path that fails at load falls back to native, and says so."""
        cfg = model.config
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_cache_blocks = num_blocks + 1
        self.max_num_seqs = max_num_seqs
        if decode_attention is None:
            decode_attention = "flex" if self.device.type == "cuda" else "native"
        if decode_attention not in ("flex", "native"):
            raise ValueError(f"decode_attention must be 'flex' or 'native', got {decode_attention!r}")
        self.use_flex = decode_attention == "flex"
        self.sampled_hidden: torch.Tensor | None = None  # [R, hidden] of the last dynamic step's sampled rows
        self.staging = DeviceStaging(self.device)  # the dynamic path's int64 inputs: one host-to-device copy a step
        # One block past the pool's: the scratch block that padded rows of static decode steps write to.
        shape = ((num_blocks + 1) * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]
        # A mixture-of-experts layer reads its per-expert row counts on the host (models/moe.py): it cannot be
        # captured in a CUDA graph, so it decodes on the dynamic path by default (static steps run eagerly if asked).
        moe = getattr(cfg, "moe", None) is not None
        if static_decode is None:  # not for encoder-decoder models: the static buffers hold no cross-attention state
            static_decode = self.device.type == "cuda" and not getattr(model, "is_encoder_decoder", False) and not moe
        self.static: StaticDecoder | None = None
        if static_decode:
            self.static = StaticDecoder(
                model,
                self.kv_caches,
                block_size,
                scratch_block=num_blocks,
                max_batch=max_num_seqs,
                max_blocks=-(-cfg.max_model_len // block_size),
                use_graphs=self.device.type == "cuda" and not moe,
            )
            self.static.use_flex = self.use_flex

    def set_decode_attention(self, kind: str) -> None:
        """Switch the decode attention ("flex" or "native") before `prepare` (tests; the load-time fallback)."""
        self.use_flex = kind == "flex"
        if self.static is not None:
            self.static.reset()
            self.static.use_flex = self.use_flex

    def prepare(self) -> None:
        """Check the decode attention and build every static decode bucket (CUDA graphs on a GPU) now, at load,
        before the engine serves. A flex path that fails here (no compiler, a kernel limit) falls back to native."""
        with torch.cuda.device(self.device) if self.device.type == "cuda" else _nullcontext():
            if self.use_flex:
                try:
                    self._probe_flex()
                    if self.static is not None:
                        self.static.build_all()
                except Exception:
                    log.exception("FlexAttention decode failed at load; falling back to the gathered SDPA path")
                    self.set_decode_attention("native")
            if self.static is not None and not self.static.frozen:
                self.static.build_all()
        log.info("decode attention: %s", self.describe_decode_attention())

    def describe_decode_attention(self) -> str:
        if self.use_flex:
            return "FlexAttention over the paged cache in place" + (" (compiled)" if self.device.type == "cuda" else "")
        if self.device.type != "cuda":
            return "CPU paged kernel or gathered matmul"
        cfg = self.model.config
        dt = self.kv_caches[0][0].dtype
        q = torch.zeros(1, cfg.num_heads, 1, cfg.head_dim, dtype=dt, device=self.device)
        k = torch.zeros(1, cfg.num_kv_heads, 4 * self.block_size, cfg.head_dim, dtype=dt, device=self.device)
        mask = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool, device=self.device)
        return f"gathered blocks + SDPA ({sdpa_backend_name(q, k, k, mask)} backend)"

    @torch.inference_mode()
    def _probe_flex(self) -> None:
        """One decode attention call through the flex path on the scratch block (compiles it on CUDA)."""
        cfg = self.model.config
        k_cache, v_cache = self.kv_caches[0]
        scratch = torch.full((1, 1), self.num_cache_blocks - 1, dtype=torch.long, device=self.device)
        lens = torch.ones(1, dtype=torch.long, device=self.device)
        mask = paged_block_mask(scratch, lens, self.block_size, self.num_cache_blocks, self.max_num_seqs)
        q = torch.zeros(1, cfg.num_heads, cfg.head_dim, dtype=k_cache.dtype, device=self.device)
        decode_attention_flex(q, k_cache, v_cache, mask, cfg.head_dim**-0.5)

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of token positions [start, end)."""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        blocks = torch.tensor(block_table[first : last + 1])
        slots = (blocks.unsqueeze(1) * bs + torch.arange(bs)).flatten()
        return slots[start - first * bs : end - first * bs]

    def _static_step(self, singles: list[ScheduledChunk]) -> torch.Tensor | None:
        """Logits [R, vocab] of a decode-only step through the replayed static graphs (engine/static_decode.py);
        None when there are none or the step does not fit them. Only for steps with one 1-D token per request and
        no cross-attention: the static buffers hold 1-D positions that double as KV slots, and no per-request
        cross-attention state."""
        if self.static is None or not self.static.fits(len(singles), max(c.end for c in singles)):
            return None
        return self.static.run(
            [c.request.token_id(c.start) for c in singles],
            [c.start for c in singles],
            [c.request.block_table for c in singles],
        )

    def _decode_tables(self, singles: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each decode token's own KV slot [nd], block tables [nd, max_blocks] padded with block 0, lengths [nd])."""
        bs = self.block_size
        lens = [c.end for c in singles]
        max_blocks = -(-max(lens) // bs)
        padded = [bt + [0] * (max_blocks - len(bt)) for bt in (c.request.block_table[:max_blocks] for c in singles)]
        table = torch.tensor(padded, dtype=torch.long)  # [nd, max_blocks]
        lens_t = torch.tensor(lens, dtype=torch.long)
        last = lens_t - 1  # each decode token's own slot
        own = table.gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs
        return own, table, lens_t

    @staticmethod
    def _logit_rows(chunks: list[ScheduledChunk]) -> list[int]:
        """The hidden rows whose logits are computed: each chunk's last num_verify rows, in row order."""
        rows: list[int] = []
        row = 0
        for c in chunks:
            row += c.num_tokens
            rows.extend(range(row - c.num_verify, row))
        return rows

    @torch.inference_mode()
    def execute(
        self, plan: SchedulePlan, window: tuple[int, int] | None = None, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, list[ScheduledChunk]]:
        """Run the plan; returns logits [R, vocab] (float32) and the chunks that sample, in row order: each sampling
        chunk owns `num_verify` consecutive rows (the logits of its last num_verify positions). With `window`
        (lo, hi) the logits are [R, hi - lo], of vocabulary rows lo..hi-1 only (engine/vocab_window.py).
        input_ids: the step's token ids [T] already on the device (a draft model's last sample, not yet read back),
        used instead of the requests' own (dynamic path only)."""
        singles = [c for c in plan.decodes if c.num_tokens == 1]  # one token each: the decode attention path
        multis = [c for c in plan.decodes if c.num_tokens > 1] + plan.prefills  # chunks over a cached context
        mrope = any(c.request.rope_positions is not None for c in plan.chunks)
        cross_attends = getattr(self.model, "is_encoder_decoder", False)
        static = input_ids is None and not cross_attends and not multis and not mrope
        if static and (logits := self._static_step(singles)) is not None:  # replayed decode graphs
            return (logits if window is None else logits[:, window[0] : window[1]]), list(singles)
        dev, bs = self.device, self.block_size
        chunks = singles + multis
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        embed_rows: list[torch.Tensor] = []
        embed_vals: list[torch.Tensor] = []
        prefill_spans: list[tuple[int, int, int]] = []  # (first row, rows, context length) per multi-token chunk
        prefill_blocks: list[tuple[tuple[int, int], ...]] = []  # bidirectional segments each chunk computes
        prefill_tables: list[torch.Tensor] = []
        cross: list[tuple[int, int, torch.Tensor]] = []  # encoder-decoder: (first row, rows, cross K/V) per chunk
        row = 0
        for k, c in enumerate(chunks):
            req = c.request
            if cross_attends:
                assert req.encoder_input is not None, "an encoder-decoder request without its encoder input"
                cross.append((row, c.num_tokens, req.encoder_input.result()))
            ids.extend(req.token_slice(c.start, c.end))
            span = req.rope_span(c.start, c.end)
            pos.append(span.expand(3, -1) if mrope and span.dim() == 1 else span)  # a mixed step: all [3, n]
            for seg in req.segments:
                lo, hi = max(c.start, seg.start), min(c.end, seg.end)
                if lo < hi:  # only now are the segment's embeddings needed (produced on first use)
                    embed_rows.append(torch.arange(row + lo - c.start, row + hi - c.start))
                    embed_vals.append(seg.embeds()[lo - seg.start : hi - seg.start])
            if k >= len(singles):
                slot_parts.append(self._slots(req.block_table, c.start, c.end))
                prefill_tables.append(torch.tensor(req.block_table[: -(-c.end // bs)], dtype=torch.long))
                prefill_spans.append((row, c.num_tokens, c.end))
                prefill_blocks.append(
                    tuple(
                        (g.start, g.end)
                        for g in req.segments
                        if g.bidirectional and g.start < c.end and g.end > c.start
                    )
                )
            row += c.num_tokens

        nd = len(singles)
        decode_parts: list[torch.Tensor] = []
        if nd:
            own, *decode_parts = self._decode_tables(singles)
            slot_parts.insert(0, own)

        sampling = [c for c in chunks if c.samples]
        logit_rows = self._logit_rows(chunks)
        # Every int64 input of the step goes up in one copy (pinned and non-blocking on CUDA).
        staged = iter(
            self.staging(
                [
                    torch.tensor(ids, dtype=torch.long),
                    torch.cat(pos, dim=-1).long(),
                    torch.cat(slot_parts),
                    torch.tensor(logit_rows, dtype=torch.long),
                    *decode_parts,
                    *prefill_tables,
                    *([torch.cat(embed_rows)] if embed_rows else []),
                ]
            )
        )
        staged_ids, positions, slot_mapping, logit_index = next(staged), next(staged), next(staged), next(staged)
        input_ids = staged_ids if input_ids is None else input_ids
        decode_tables = decode_mask = decode_lens = None
        if nd:
            decode_tables, decode_lens = next(staged), next(staged)
            span = torch.arange(decode_tables.shape[1] * bs, device=dev)
            decode_mask = (span[None, :] < decode_lens[:, None]).view(nd, 1, 1, -1)
        prefills = [PrefillChunk(*s, next(staged), b) for s, b in zip(prefill_spans, prefill_blocks, strict=True)]
        rows = next(staged) if embed_rows else None
        meta = AttentionMetadata(
            block_size=bs,
            slot_mapping=slot_mapping,
            num_decode=nd,
            decode_block_tables=decode_tables,
            decode_mask=decode_mask,
            decode_lens=decode_lens,
            prefills=prefills,
        )
        if nd and self.use_flex:
            n_rows = max(nd, self.max_num_seqs)  # one compiled shape for every step
            meta.decode_block_mask = paged_block_mask(decode_tables, decode_lens, bs, self.num_cache_blocks, n_rows)
        vals = torch.cat([v.to(dev) for v in embed_vals]) if embed_vals else None
        cross_kw = {"cross": cross} if cross_attends else {}  # encoder-decoder: each chunk's cross K/V
        hidden = self.model(input_ids, positions, self.kv_caches, meta, rows, vals, **cross_kw)
        return (self._logits(hidden, logit_index, window) if sampling else None), sampling

    def _logits(self, hidden: torch.Tensor, logit_index: torch.Tensor, window: tuple[int, int] | None) -> torch.Tensor:
        """Logits [R, vocab] (or [R, hi - lo] of a vocabulary window) of the hidden rows that sample."""
        last = hidden.index_select(0, logit_index)
        self.sampled_hidden = last  # the rows a frame model's depth decoder starts from (engine/frame_step.py)
        return self.model.compute_logits(last) if window is None else self.model.compute_logits(last, window)

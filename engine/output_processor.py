"""The output side: stop rules, incremental detokenization, logprobs, and handing RequestOutputs to consumers.

Each request's output state (detokenizer, logprobs so far, its consumer's callback) lives here, not on the Request.
`process()` takes the tokens a step accepted for a request and decides whether it stops; the engine then tells the
core to finish it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnivox.engine.detokenizer import IncrementalDetokenizer
from omnivox.engine.outputs import OutputHistory, RequestOutput, TokenLogprob
from omnivox.engine.request import Request

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


@dataclass
class OutputState:
    detok: IncrementalDetokenizer | None  # None: the request asked for token ids only (detokenize=False)
    on_output: OutputCallback | None
    history: OutputHistory  # what has been emitted (tokens, text, logprobs), shared by the request's outputs
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of accepted tokens not yet emitted
    first_token_time: float | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._states: dict[str, OutputState] = {}

    def add(self, req: Request, on_output: OutputCallback | None) -> None:
        p = req.params
        detok = None
        if p.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, p.stop, p.include_stop_str_in_output, p.skip_special_tokens
            )
        self._states[req.request_id] = OutputState(detok, on_output, OutputHistory(p.logprobs is not None))

    def process(
        self, req: Request, token_ids: list[int], logprobs: list[TokenLogprob | None], now: float
    ) -> tuple[str | None, RequestOutput | None]:
        """Apply the stop rules to the tokens a step accepted (already appended to the request), in order.

        Returns (finish reason, None) when the request stops — tokens after the stopping one are dropped from its
        output; the caller finishes it and calls `finish` — or (None, the output delivered to its consumer, if any).
        """
        state = self._states[req.request_id]
        p, detok = req.params, state.detok
        if state.first_token_time is None:
            state.first_token_time = now
        n_before = req.num_output_tokens - len(token_ids)
        for k, (token, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
            if lp is not None:
                state.logprobs.append(lp)
            num_out = n_before + k + 1
            reason = None
            if (
                (not p.ignore_eos and token in req.eos_token_ids)
                or (p.stop_token_ids and token in p.stop_token_ids)
                or (detok is not None and detok.add(token))
                or req.frames_ended  # a frame model's end frame (engine/frame_step.py)
            ):
                reason = "stop"
            elif num_out >= req.max_tokens or len(req.prompt_token_ids) + num_out >= self.max_model_len:
                reason = "length"
            if reason is not None:
                del req.output_token_ids[num_out:]
                return reason, None
        return None, self._emit(req, state, finished=False)

    def finish(self, req: Request) -> RequestOutput:
        """Deliver the request's last output (its finish_reason is set) and forget its state."""
        state = self._states.pop(req.request_id)
        out = self._emit(req, state, finished=True)
        assert out is not None
        return out

    def _emit(self, req: Request, state: OutputState, finished: bool) -> RequestOutput | None:
        """The output of what is new since the previous one: O(new tokens), whatever the length so far."""
        history = state.history
        new_tokens = req.output_token_ids[len(history.token_ids) :]
        detok = state.detok
        new_text = detok.take(final=finished) if detok is not None else ""
        if not new_tokens and not new_text and not finished:
            return None
        emitted = len(history.token_ids)
        history.token_ids += new_tokens
        new_frames = req.output_frames[emitted : emitted + len(new_tokens)]
        history.frames += new_frames
        if new_text:
            history.text_parts.append(new_text)
        new_lp = None
        if history.logprobs is not None:
            new_lp, state.logprobs = state.logprobs, []
            history.logprobs += new_lp
        out = RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            history=history,
            num_tokens=len(history.token_ids),
            num_text_parts=len(history.text_parts),
            num_logprobs=len(history.logprobs) if history.logprobs is not None else 0,
            new_token_ids=new_tokens,
            new_text=new_text,
            new_logprobs=new_lp,
            new_frames=new_frames,
            finish_reason=req.finish_reason if finished else None,
            error=req.error if finished else None,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            first_token_time=state.first_token_time,
            arrival_time=req.arrival_time,
        )
        if state.on_output is not None:
            try:
                state.on_output(out)
            except Exception:  # a consumer that went away must not stop the engine
                log.exception("output callback of %s failed", req.request_id)
        return out

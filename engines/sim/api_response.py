"""vLLM 0.33's response JSON for the simulator: stream chunks, the final usage chunk, whole responses."""

from __future__ import annotations

import time
from typing import Any

import orjson

from specproxy.engines.sim.api_request import ParsedRequest
from specproxy.engines.sim.config import SimConfig
from specproxy.engines.sim.engine import Sequence


class ResponseShaper:
    """Builds vLLM's JSON for one request (one sequence per choice): stream chunks or the whole response."""

    def __init__(self, config: SimConfig, req: ParsedRequest, seqs: list[Sequence]) -> None:
        self.req = req
        self.seqs = seqs
        self.config = config
        prefix = "chatcmpl-" if req.chat else "cmpl-"
        self.id = prefix + req.base_id
        self.created = int(time.time())
        self.model = config.served_name
        self.prompt_tokens = seqs[0].prompt_len
        self.prompt_ids = list(seqs[0].spec.prompt.token_ids)
        self.text_offsets = [0] * len(seqs)

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    def _chat_logprobs(self, i: int, start: int, end: int) -> dict[str, Any]:
        target = self.seqs[i].target
        top = self.req.logprobs or 0
        content = []
        for pos in range(start, end):
            chosen, alts = target.logprobs(pos, max(top, 1))
            piece = target.pieces[pos]
            content.append(
                {
                    "token": piece,
                    "logprob": chosen,
                    "bytes": list(piece.encode()),
                    "top_logprobs": [
                        {"token": p, "logprob": lp, "bytes": list(p.encode())} for _, p, lp in alts[:top]
                    ],
                }
            )
        return {"content": content}

    def _completion_logprobs(self, i: int, start: int, end: int) -> dict[str, Any]:
        target = self.seqs[i].target
        top = self.req.logprobs or 0
        tokens, token_lps, tops, offsets = [], [], [], []
        for pos in range(start, end):
            chosen, alts = target.logprobs(pos, max(top, 1))
            piece = target.pieces[pos]
            tokens.append(piece)
            token_lps.append(chosen)
            tops.append({p: lp for _, p, lp in alts[: max(top, 1)]} if top else None)
            offsets.append(self.text_offsets[i])
            self.text_offsets[i] += len(piece)
        return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}

    def _metrics(self, streaming: bool) -> dict[str, Any] | None:
        level = self.config.per_request_spec_decode_metrics
        # vLLM reports per-request speculation only for single-sequence requests.
        if level == "none" or self.config.speculative is None or len(self.seqs) != 1:
            return None
        spec = self.seqs[0].truth.spec_decoding_metrics(detailed=level == "detailed")
        if streaming:
            return {"speculative_decoding": spec}
        return {
            "time_to_first_token_ms": None,
            "generation_time_ms": None,
            "queue_time_ms": None,
            "mean_itl_ms": None,
            "tokens_per_second": None,
            "speculative_decoding": spec,
        }

    def first_chunk(self, i: int) -> bytes:
        """Chat only: the role chunk vLLM sends for each choice when the first output arrives."""
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_token_ids": self.prompt_ids if self.req.return_token_ids else None,
            "prompt_text": None,
        }
        if self.req.continuous_usage:
            chunk["usage"] = {**self.usage(0), "completion_tokens_details": None}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def delta_chunk(self, i: int, start: int, end: int) -> bytes:
        seq, req = self.seqs[i], self.req
        done = seq.finished and end >= seq.n_out
        text = seq.output_text(start, end)
        token_ids = seq.output_ids(start, end) if req.return_token_ids else None
        finish = seq.finish_reason if done else None
        chunk: dict[str, Any]
        if req.chat:
            logprobs = self._chat_logprobs(i, start, end) if req.logprobs is not None else None
            choice: dict[str, Any] = {
                "index": i,
                "delta": {"content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
                "token_ids": token_ids,
            }
            if done:
                choice["stop_reason"] = seq.stop_reason
            chunk = {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "kv_transfer_params": None,
            }
        else:
            logprobs = self._completion_logprobs(i, start, end) if req.logprobs is not None else None
            choice = {
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": seq.stop_reason if done else None,
                "token_ids": token_ids,
            }
            if start == 0:
                choice["prompt_token_ids"] = self.prompt_ids if req.return_token_ids else None
            chunk = {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "kv_transfer_params": None,
            }
        if req.continuous_usage:
            usage = self.usage(end)
            if req.chat:  # vLLM's chat path sets completion_tokens_details explicitly (null)
                usage["completion_tokens_details"] = None
            chunk["usage"] = usage
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def usage_chunk(self) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.req.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(sum(s.n_out for s in self.seqs)),
        }
        metrics = self._metrics(streaming=True)
        if metrics is not None:
            chunk["metrics"] = metrics
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def _chat_choice(self, i: int) -> dict[str, Any]:
        seq, req = self.seqs[i], self.req
        message: dict[str, Any] = {
            "role": "assistant",
            "content": seq.output_text(),
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning": None,
        }
        return {
            "index": i,
            "message": message,
            "logprobs": self._chat_logprobs(i, 0, seq.n_out) if req.logprobs is not None else None,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "token_ids": seq.output_ids() if req.return_token_ids else None,
        }

    def _completion_choice(self, i: int) -> dict[str, Any]:
        seq, req = self.seqs[i], self.req
        return {
            "index": i,
            "text": seq.output_text(),
            "logprobs": self._completion_logprobs(i, 0, seq.n_out) if req.logprobs is not None else None,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "token_ids": seq.output_ids() if req.return_token_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": self.prompt_ids if req.return_token_ids else None,
        }

    def full_response(self) -> dict[str, Any]:
        req = self.req
        usage = {
            **self.usage(sum(s.n_out for s in self.seqs)),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        body: dict[str, Any]
        if req.chat:
            body = {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [self._chat_choice(i) for i in range(len(self.seqs))],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "prompt_logprobs": None,
                "prompt_token_ids": self.prompt_ids if req.return_token_ids else None,
                "kv_transfer_params": None,
            }
        else:
            body = {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [self._completion_choice(i) for i in range(len(self.seqs))],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "kv_transfer_params": None,
            }
        metrics = self._metrics(streaming=False)
        if metrics is not None:
            body["metrics"] = metrics
        return body

"""Measure a GPU's step-time profile for the simulator: `python -m specproxy.engines.calibrate --out DIR`.

Times the forward passes that a vLLM engine step is made of, on random bf16 weights of the real
shapes, and fits the simulator's cost profile (engines/calibrate_fit.py) to them:

- the target, a Llama-3.1-8B-shaped decoder (32 layers, hidden 4096, 32 query / 8 KV heads, MLP
  14336, vocab 128256), over a KV cache, for batch B x query tokens per request q (1 = decode,
  k+1 = verification) x context per request; logits for every query token, as verification needs;
- a Llama-3.2-1B-shaped draft model (16 layers, hidden 2048, 32/8 heads of 64, MLP 8192), one
  forward over the batch (one token per request);
- EAGLE3- and EAGLE-1-shaped heads drafting k tokens for the batch: fc over the concatenated target
  hidden states (3x4096 or 2x4096 -> 4096), one decoder layer whose attention takes [embedding;
  hidden] (EAGLE3: qkv in 8192) and an LM head (EAGLE3: 32000-token draft vocabulary), first over the
  B*(k+1) tokens the last verification produced, then k-1 chained steps over B tokens;
- prefill chunks of one fresh prompt (causal attention, logits for the last token only);
- a device-to-device copy, whose bandwidth sets the weight-read floor of a decode step.

Every timed thing is captured once as a CUDA graph and replayed (a decode step is ~600 small
kernels: eager launch overhead, not the GPU, would otherwise dominate, as calibration.md's eager
probe showed), timed with CUDA events around each replay; the median of the replays is kept.

Attention: decode and verification use torch's fused SDPA with the 4 query heads of each KV head
folded into the query length (the flash-decoding trick for GQA: the KV cache is read once per KV
head, never expanded), with no mask: the q query tokens attend to all ctx+q keys, which costs the
same as the causal mask within those q tokens to within q^2 of ctx*q. The SDPA backend is chosen
by timing each available one on two decode shapes at start. Differences from a vLLM step that the
profile inherits: no paged KV (one contiguous cache per request, every request the same length),
torch's unfused RMSNorm/rotary/SiLU kernels where vLLM fuses them, no sampler, no scheduler (that
is `step_overhead_s`, kept from the H100 fit).

torch is imported lazily: this module is importable (and its CPU path testable with `--tiny
--device cpu`) without a GPU; specproxy does not depend on torch.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from specproxy.engines.calibrate_fit import POINT_COLUMNS, Point, build_profile, profile_problems, read_points

# Each KV-cache token of the 8B model takes 32 layers x (K, V) x 8 heads x 128 x 2 bytes = 128 KiB;
# the cache is capped at this many tokens for the whole batch (64 GiB + the verification tokens),
# which drops B*ctx beyond 512k (e.g. 128 x 8k), well inside the H200's memory next to 16 GB of weights.
MAX_KV_TOKENS = 2**19


@dataclass(frozen=True)
class DecoderShape:
    """A Llama-style decoder's shapes."""

    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int

    @property
    def qkv_out(self) -> int:
        return (self.q_heads + 2 * self.kv_heads) * self.head_dim

    def layer_params(self, qkv_in: int | None = None) -> int:
        qkv_in = qkv_in or self.hidden
        attn = qkv_in * self.qkv_out + self.q_heads * self.head_dim * self.hidden
        return attn + 3 * self.hidden * self.mlp

    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2


LLAMA_3_1_8B = DecoderShape(
    layers=32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=128256
)
LLAMA_3_2_1B = DecoderShape(
    layers=16, hidden=2048, q_heads=32, kv_heads=8, head_dim=64, mlp=8192, vocab=128256
)
# For running the whole script on a CPU in seconds (tests, a dry run before spending GPU time).
TINY_TARGET = DecoderShape(layers=2, hidden=64, q_heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=512)
TINY_DRAFT = DecoderShape(layers=1, hidden=32, q_heads=4, kv_heads=2, head_dim=8, mlp=64, vocab=512)


@dataclass(frozen=True)
class EagleShape:
    """An EAGLE-style draft head on top of a target of `base` shape."""

    name: str
    fc_inputs: int  # how many target hidden states the fc concatenates (EAGLE3: 3 layers' outputs)
    qkv_in: int  # EAGLE3's layer attends over [embedding; hidden], so its qkv takes 2*hidden
    draft_vocab: int


def eagle_shapes(base: DecoderShape, tiny: bool = False) -> list[EagleShape]:
    vocab3 = 32000 if not tiny else base.vocab // 2
    return [
        EagleShape("eagle3", fc_inputs=3, qkv_in=2 * base.hidden, draft_vocab=vocab3),
        EagleShape("eagle", fc_inputs=2, qkv_in=base.hidden, draft_vocab=base.vocab),
    ]


@dataclass(frozen=True)
class Grid:
    """What to time. Sizes cap at MAX_KV_TOKENS of KV for the batch."""

    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    query_tokens: tuple[int, ...] = (1, 2, 4, 8)
    contexts: tuple[int, ...] = (512, 1024, 2048, 8192)
    draft_ks: tuple[int, ...] = (1, 3, 5)
    prefill_chunks: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    max_kv_tokens: int = MAX_KV_TOKENS
    copy_bytes: int = 4 << 30

    def target_configs(self) -> list[tuple[int, int, int]]:
        """(B, q, ctx) triples whose KV fits, small contexts and batches first."""
        return [
            (b, q, c)
            for c in self.contexts
            for b in self.batches
            for q in self.query_tokens
            if b * (c + q) <= self.max_kv_tokens + b * max(self.query_tokens)
        ]


TINY_GRID = Grid(
    batches=(1, 2, 4),
    query_tokens=(1, 2),
    contexts=(16, 32),
    draft_ks=(1, 2),
    prefill_chunks=(8, 16),
    max_kv_tokens=4 * 32,
    copy_bytes=1 << 20,
)


class Calibrator:
    """Holds the device, random weights and the KV-cache buffer; each `time_*` returns one Point.

    Everything torch-specific lives here, behind a lazy import.
    """

    def __init__(
        self, device: str, target: DecoderShape, draft: DecoderShape, grid: Grid, tiny: bool
    ) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.target_shape = target
        self.draft_shape = draft
        self.grid = grid
        self.tiny = tiny
        torch.manual_seed(0)
        self.target = self._decoder_weights(target)
        self.draft = self._decoder_weights(draft)
        self.eagles = {e.name: (e, self._eagle_weights(target, e)) for e in eagle_shapes(target, tiny)}
        max_q = max(grid.query_tokens)
        self.max_cache_tokens = max(b * (c + max_q) for b, _, c in grid.target_configs())
        # One flat buffer per model, viewed as [B, kv_heads, ctx+q, head_dim] per layer for each
        # configuration; filled with random values (never time on zeros).
        self.target_cache = self._cache(target, self.max_cache_tokens)
        self.draft_cache = self._cache(draft, self.max_cache_tokens)
        eagle_layer = DecoderShape(1, target.hidden, target.q_heads, target.kv_heads, target.head_dim, 1, 1)
        eagle_tokens = max(b * (c + 2 * max(grid.draft_ks) + 1) for b, _, c in grid.target_configs())
        self.eagle_cache = self._cache(eagle_layer, eagle_tokens)
        self.sdpa_backends: list[Any] = []
        self.sdpa_backend_name = "default"

    # weights ------------------------------------------------------------------------------
    def _rand(self, *shape: int, std: float = 0.02) -> Any:
        return self.torch.empty(*shape, device=self.device, dtype=self.dtype).normal_(0.0, std)

    def _layer(self, s: DecoderShape, qkv_in: int) -> dict[str, Any]:
        return {
            "ln1": self._rand(qkv_in, std=1.0).abs_(),
            "wqkv": self._rand(s.qkv_out, qkv_in),
            "wo": self._rand(s.hidden, s.q_heads * s.head_dim),
            "ln2": self._rand(s.hidden, std=1.0).abs_(),
            "wgu": self._rand(2 * s.mlp, s.hidden),
            "wdown": self._rand(s.hidden, s.mlp),
        }

    def _decoder_weights(self, s: DecoderShape) -> dict[str, Any]:
        return {
            "embed": self._rand(s.vocab, s.hidden),
            "layers": [self._layer(s, s.hidden) for _ in range(s.layers)],
            "norm": self._rand(s.hidden, std=1.0).abs_(),
            "lm_head": self._rand(s.vocab, s.hidden),
        }

    def _eagle_weights(self, s: DecoderShape, e: EagleShape) -> dict[str, Any]:
        return {
            "fc": self._rand(s.hidden, e.fc_inputs * s.hidden),
            "layer": self._layer(s, e.qkv_in),
            "norm": self._rand(s.hidden, std=1.0).abs_(),
            "lm_head": self._rand(e.draft_vocab, s.hidden),
        }

    def _cache(self, s: DecoderShape, tokens: int) -> Any:
        buf = self.torch.empty(
            s.layers, 2, tokens * s.kv_heads * s.head_dim, device=self.device, dtype=self.dtype
        )
        return buf.normal_()

    def weight_bytes_read_per_step(self) -> int:
        """Bytes of target weights a decode step reads: every layer and the LM head (the embedding
        table is only gathered, a few rows)."""
        s = self.target_shape
        return int((s.layers * s.layer_params() + s.vocab * s.hidden) * self.dtype.itemsize)

    # building blocks -----------------------------------------------------------------------
    def _rms_norm(self, x: Any, w: Any) -> Any:
        f = self.torch.nn.functional
        if hasattr(f, "rms_norm"):
            return f.rms_norm(x, (x.shape[-1],), w, 1e-5)
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * self.torch.rsqrt(var + 1e-5)).to(x.dtype) * w

    def _rope_tables(self, s: DecoderShape, start: int, length: int) -> tuple[Any, Any]:
        torch = self.torch
        half = s.head_dim // 2
        inv = 1.0 / (500000.0 ** (torch.arange(half, device=self.device, dtype=torch.float32) / half))
        pos = torch.arange(start, start + length, device=self.device, dtype=torch.float32)
        ang = torch.outer(pos, inv)
        return ang.cos().to(self.dtype)[:, None, :], ang.sin().to(self.dtype)[:, None, :]

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        # x: [B, q, heads, head_dim]; cos/sin: [q, 1, head_dim/2]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _sdpa(self, q: Any, k: Any, v: Any, causal: bool = False) -> Any:
        f = self.torch.nn.functional
        if self.sdpa_backends:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(self.sdpa_backends):
                return f.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return f.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def _attn_over_cache(self, s: DecoderShape, q: Any, k_all: Any, v_all: Any) -> Any:
        """q: [B, n, q_heads, hd] attending (unmasked) to k_all/v_all [B, kv_heads, L, hd].

        The group of query heads sharing one KV head is folded into the query length, so SDPA
        reads each KV head once (no repeat of the cache)."""
        b, n, _, hd = q.shape
        g = s.q_heads // s.kv_heads
        qf = q.view(b, n, s.kv_heads, g, hd).permute(0, 2, 3, 1, 4).reshape(b, s.kv_heads, g * n, hd)
        o = self._sdpa(qf, k_all, v_all)
        return o.view(b, s.kv_heads, g, n, hd).permute(0, 3, 1, 2, 4).reshape(b * n, s.q_heads * hd)

    def _decoder_layer(
        self,
        s: DecoderShape,
        w: dict[str, Any],
        x: Any,
        layer_in: Any,
        b: int,
        n: int,
        k_cache: Any,
        v_cache: Any,
        ctx: int,
        rope: tuple[Any, Any],
    ) -> Any:
        """One pre-norm Llama layer over T = b*n tokens; writes the new K/V at ctx..ctx+n-1."""
        f = self.torch.nn.functional
        hd = s.head_dim
        h = self._rms_norm(layer_in, w["ln1"])
        qkv = f.linear(h, w["wqkv"])
        qk = qkv[:, : (s.q_heads + s.kv_heads) * hd].view(b, n, s.q_heads + s.kv_heads, hd)
        qk = self._rope(qk, *rope)
        q, k = qk[:, :, : s.q_heads], qk[:, :, s.q_heads :]
        v = qkv[:, (s.q_heads + s.kv_heads) * hd :].view(b, n, s.kv_heads, hd)
        k_cache[:, :, ctx : ctx + n].copy_(k.transpose(1, 2))
        v_cache[:, :, ctx : ctx + n].copy_(v.transpose(1, 2))
        o = self._attn_over_cache(s, q, k_cache, v_cache)
        x = x + f.linear(o, w["wo"])
        h = self._rms_norm(x, w["ln2"])
        gate, up = f.linear(h, w["wgu"]).chunk(2, dim=-1)
        return x + f.linear(f.silu(gate) * up, w["wdown"])

    def _cache_views(self, s: DecoderShape, buf: Any, layer: int, b: int, length: int) -> tuple[Any, Any]:
        n = b * s.kv_heads * length * s.head_dim
        return (
            buf[layer, 0, :n].view(b, s.kv_heads, length, s.head_dim),
            buf[layer, 1, :n].view(b, s.kv_heads, length, s.head_dim),
        )

    # step builders: each returns a zero-argument function over static tensors -----------------
    def decoder_step(self, model: str, b: int, n: int, ctx: int) -> Callable[[], Any]:
        """One forward of the target or draft model: b requests x n new tokens over ctx cached."""
        torch, f = self.torch, self.torch.nn.functional
        s, w, buf = (
            (self.target_shape, self.target, self.target_cache)
            if model == "target"
            else (self.draft_shape, self.draft, self.draft_cache)
        )
        tokens = torch.randint(0, s.vocab, (b * n,), device=self.device)
        rope = self._rope_tables(s, ctx, n)
        caches = [self._cache_views(s, buf, i, b, ctx + n) for i in range(s.layers)]

        def step() -> Any:
            x = f.embedding(tokens, w["embed"])
            for i, lw in enumerate(w["layers"]):
                x = self._decoder_layer(s, lw, x, x, b, n, caches[i][0], caches[i][1], ctx, rope)
            return f.linear(self._rms_norm(x, w["norm"]), w["lm_head"]).argmax(-1)

        return step

    def eagle_step(self, name: str, b: int, k: int, ctx: int) -> Callable[[], Any]:
        """Draft k tokens for b requests: the first pass runs over the b*(k+1) tokens the last
        verification scored, the next k-1 over b tokens each (chain drafting, as vLLM does).

        EAGLE3 applies its fc once, to the three target hidden states, and its layer attends over
        [embedding; hidden]; EAGLE-1 applies its fc to [embedding; hidden] on every pass."""
        torch, f = self.torch, self.torch.nn.functional
        s = self.target_shape
        e, w = self.eagles[name]
        fc_once = e.fc_inputs == 3
        n0 = k + 1
        hidden_in = self._rand(b * n0, (e.fc_inputs if fc_once else 1) * s.hidden, std=1.0)
        tokens = torch.randint(0, s.vocab, (b * n0,), device=self.device)
        k_cache, v_cache = self._cache_views(s, self.eagle_cache, 0, b, ctx + n0 + k)
        ropes = [self._rope_tables(s, ctx, n0)] + [
            self._rope_tables(s, ctx + n0 + i, 1) for i in range(k - 1)
        ]
        embed = self.target["embed"]  # EAGLE heads share the target's embedding table

        def one_pass(h_prev: Any, tok: Any, n: int, at: int, rope: tuple[Any, Any]) -> Any:
            emb = f.embedding(tok, embed)
            if fc_once:
                x, layer_in = h_prev, torch.cat((emb, h_prev), dim=-1)
            else:
                x = f.linear(torch.cat((emb, h_prev), dim=-1), w["fc"])
                layer_in = x
            kc, vc = k_cache[:, :, : at + n], v_cache[:, :, : at + n]
            return self._decoder_layer(s, w["layer"], x, layer_in, b, n, kc, vc, at, rope)

        def step() -> Any:
            h0 = f.linear(hidden_in, w["fc"]) if fc_once else hidden_in
            last = one_pass(h0, tokens, n0, ctx, ropes[0]).view(b, n0, s.hidden)[:, -1]
            tok = f.linear(self._rms_norm(last, w["norm"]), w["lm_head"]).argmax(-1)
            drafted = [tok]
            for i in range(k - 1):
                last = one_pass(last, tok, 1, ctx + n0 + i, ropes[i + 1])
                tok = f.linear(self._rms_norm(last, w["norm"]), w["lm_head"]).argmax(-1)
                drafted.append(tok)
            return torch.stack(drafted, dim=1)

        return step

    def prefill_step(self, chunk: int) -> Callable[[], Any]:
        """One fresh prompt of `chunk` tokens: causal attention within it, logits for the last token."""
        torch, f = self.torch, self.torch.nn.functional
        s, w = self.target_shape, self.target
        tokens = torch.randint(0, s.vocab, (chunk,), device=self.device)
        rope = self._rope_tables(s, 0, chunk)
        g = s.q_heads // s.kv_heads
        hd = s.head_dim

        def step() -> Any:
            x = f.embedding(tokens, w["embed"])
            for lw in w["layers"]:
                h = self._rms_norm(x, lw["ln1"])
                qkv = f.linear(h, lw["wqkv"])
                qk = self._rope(qkv[:, : (s.q_heads + s.kv_heads) * hd].view(1, chunk, -1, hd), *rope)
                q = qk[:, :, : s.q_heads].transpose(1, 2)
                kk = qk[:, :, s.q_heads :].transpose(1, 2)
                v = qkv[:, (s.q_heads + s.kv_heads) * hd :].view(1, chunk, s.kv_heads, hd).transpose(1, 2)
                # Causal attention cannot fold query heads into the length; expanding K/V here costs
                # a copy of chunk x 8 KiB per layer, small next to the chunk's GEMMs. (expand, not
                # repeat_interleave, which may synchronise and so break graph capture.)
                kk = kk[:, :, None].expand(1, s.kv_heads, g, chunk, hd).reshape(1, s.q_heads, chunk, hd)
                v = v[:, :, None].expand(1, s.kv_heads, g, chunk, hd).reshape(1, s.q_heads, chunk, hd)
                o = self._sdpa(q, kk, v, causal=True).transpose(1, 2).reshape(chunk, s.q_heads * hd)
                x = x + f.linear(o, lw["wo"])
                h = self._rms_norm(x, lw["ln2"])
                gate, up = f.linear(h, lw["wgu"]).chunk(2, dim=-1)
                x = x + f.linear(f.silu(gate) * up, lw["wdown"])
            return f.linear(self._rms_norm(x[-1:], w["norm"]), w["lm_head"]).argmax(-1)

        return step

    # timing --------------------------------------------------------------------------------
    def _synchronize(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def _graphed(self, step: Callable[[], Any]) -> Callable[[], Any]:
        """Capture `step` as a CUDA graph (after one warm-up run on a side stream, as torch
        requires) and return its replay; on CPU, `step` itself."""
        if not self.cuda:
            return step
        torch = self.torch
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            step()
        replay: Callable[[], Any] = graph.replay
        return replay

    def _time_once(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            torch = self.torch
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            fn()
        return time.perf_counter() - t0

    def measure(self, fn: Callable[[], Any], target_s: float = 0.3) -> tuple[float, float, float, int]:
        """Median, 20th and 80th percentile of repeated timed runs (after warm-up); the count
        adapts so each configuration takes about `target_s`, between 5 and 30 runs."""
        replay = self._graphed(fn)
        for _ in range(2):
            replay()
        first = self._time_once(replay)
        reps = int(min(30, max(5, target_s / max(first, 1e-6))))
        times = sorted(self._time_once(replay) for _ in range(reps))
        return _quantile(times, 0.5), _quantile(times, 0.2), _quantile(times, 0.8), reps

    def choose_sdpa_backend(self, log: Callable[[str], None]) -> None:
        """Time each fused SDPA backend on two folded-GQA decode shapes; keep the fastest that works."""
        if not self.cuda:
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel

        torch, f = self.torch, self.torch.nn.functional
        s = self.target_shape
        g = s.q_heads // s.kv_heads
        shapes = [(1, 8192, 1), (64, 2048, 4)]
        results: dict[str, float] = {}
        for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            backend = getattr(SDPBackend, name, None)
            if backend is None:
                continue
            total = 0.0
            try:
                for b, length, n in shapes:
                    q = self._rand(b, s.kv_heads, g * n, s.head_dim, std=1.0)
                    kv = self._rand(b, s.kv_heads, length, s.head_dim, std=1.0)

                    def run(q: Any = q, kv: Any = kv, backend: Any = backend) -> Any:
                        with sdpa_kernel([backend]):
                            return f.scaled_dot_product_attention(q, kv, kv)

                    run()
                    self._synchronize()
                    total += sorted(self._time_once(run) for _ in range(10))[5]
            except Exception as exc:  # a backend that does not support the shape: skip it
                log(f"sdpa {name}: unavailable ({type(exc).__name__}: {str(exc)[:120]})")
                continue
            results[name] = total
            log(f"sdpa {name}: {total * 1e3:.3f} ms on the probe shapes")
        if results:
            best = min(results, key=lambda k: results[k])
            self.sdpa_backends = [getattr(SDPBackend, best)]
            self.sdpa_backend_name = best
        torch.cuda.empty_cache()

    def copy_point(self) -> Point:
        """Device-to-device copy of `copy_bytes`, timed; bytes counted read plus written."""
        n = self.grid.copy_bytes // 2
        src = self.torch.empty(n, device=self.device, dtype=self.torch.bfloat16).normal_()
        dst = self.torch.empty_like(src)
        med, p20, p80, reps = self.measure(lambda: dst.copy_(src))
        return Point("copy", 0, 0, 0, 0, 0, med, p20, p80, reps, bytes=2 * n * 2)


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def plan(cal: Calibrator) -> Iterator[tuple[str, Callable[[], Point]]]:
    """Everything to time, most important first (a run cut short by its budget keeps the core)."""
    grid = cal.grid

    def target(b: int, q: int, c: int) -> Callable[[], Point]:
        def run() -> Point:
            med, p20, p80, reps = cal.measure(cal.decoder_step("target", b, q, c))
            return Point("target", b, q, c, b * q, b * (c + q), med, p20, p80, reps)

        return run

    def draft(b: int, c: int) -> Callable[[], Point]:
        def run() -> Point:
            med, p20, p80, reps = cal.measure(cal.decoder_step("draft", b, 1, c))
            return Point("draft_model", b, 1, c, b, b * (c + 1), med, p20, p80, reps)

        return run

    def eagle(name: str, b: int, k: int, c: int) -> Callable[[], Point]:
        def run() -> Point:
            med, p20, p80, reps = cal.measure(cal.eagle_step(name, b, k, c))
            return Point(name, b, k, c, b * (k + 1), b * c, med, p20, p80, reps)

        return run

    def prefill(chunk: int) -> Callable[[], Point]:
        def run() -> Point:
            med, p20, p80, reps = cal.measure(cal.prefill_step(chunk))
            return Point("prefill", 1, chunk, 0, chunk, chunk, med, p20, p80, reps)

        return run

    yield "copy", cal.copy_point
    configs = grid.target_configs()
    for b, q, c in configs:
        yield f"target B={b} q={q} ctx={c}", target(b, q, c)
    for chunk in grid.prefill_chunks:
        yield f"prefill chunk={chunk}", prefill(chunk)
    draft_configs = sorted({(b, c) for b, _, c in configs})
    for b, c in draft_configs:
        yield f"draft_model B={b} ctx={c}", draft(b, c)
    for name in ("eagle3", "eagle"):
        for b, c in draft_configs:
            for k in grid.draft_ks:
                yield f"{name} B={b} k={k} ctx={c}", eagle(name, b, k, c)


def describe_stack(cal: Calibrator) -> dict[str, Any]:
    """Where the numbers came from: torch, CUDA, GPU, driver, SDPA backend, weight bytes."""
    torch = cal.torch
    stack: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cal.cuda else None,
        "device": str(cal.device),
        "dtype": str(cal.dtype).removeprefix("torch."),
        "sdpa_backend": cal.sdpa_backend_name,
        "cuda_graphs": cal.cuda,
        "weight_bytes_read_per_step": cal.weight_bytes_read_per_step(),
        "target_shape": asdict(cal.target_shape),
        "draft_shape": asdict(cal.draft_shape),
        "eagle_shapes": [asdict(e) for e, _ in cal.eagles.values()],
        "max_kv_tokens": cal.grid.max_kv_tokens,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if cal.cuda:
        props = torch.cuda.get_device_properties(cal.device)
        stack["gpu"] = props.name
        stack["gpu_memory_bytes"] = props.total_memory
        stack["sm_count"] = props.multi_processor_count
        stack["compute_capability"] = f"{props.major}.{props.minor}"
        stack["driver"] = _nvidia_smi("driver_version")
        stack["clocks_at_start"] = _nvidia_smi("clocks.sm,clocks.mem,clocks.max.sm,power.limit")
    else:
        stack["gpu"] = f"CPU ({platform.processor() or platform.machine()})"
    try:
        import flash_attn  # noqa: F401

        stack["flash_attn_package"] = getattr(sys.modules["flash_attn"], "__version__", "present")
    except ImportError:
        stack["flash_attn_package"] = None
    return stack


def _nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def run_calibration(
    out: Path, name: str, device: str, tiny: bool, budget_s: float, log: Callable[[str], None]
) -> dict[str, Any]:
    """Measure, append each point to NAME.points.csv as it is taken, then fit NAME.json."""
    started = time.monotonic()
    grid = TINY_GRID if tiny else Grid()
    target, draft = (TINY_TARGET, TINY_DRAFT) if tiny else (LLAMA_3_1_8B, LLAMA_3_2_1B)
    cal = Calibrator(device, target, draft, grid, tiny)
    log(f"weights and caches ready in {time.monotonic() - started:.1f} s")
    cal.choose_sdpa_backend(log)
    stack = describe_stack(cal)
    out.mkdir(parents=True, exist_ok=True)
    stack_path = out / f"{name}.stack.json"
    stack_path.write_text(json.dumps(stack, indent=2) + "\n")
    points_path = out / f"{name}.points.csv"
    skipped: list[str] = []
    fallbacks: list[str] = []
    with open(points_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=POINT_COLUMNS)
        writer.writeheader()
        for label, take in plan(cal):
            if time.monotonic() - started > budget_s:
                skipped.append(label)
                continue
            try:
                point = take()
            except Exception as exc:  # one failing shape (e.g. out of memory) must not lose the rest
                log(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                if cal.cuda:
                    cal.torch.cuda.synchronize()
                    cal.torch.cuda.empty_cache()
                if not cal.sdpa_backends:
                    skipped.append(label)
                    continue
                # The chosen SDPA backend may refuse a shape: retry once with torch's own dispatch.
                chosen = cal.sdpa_backends
                cal.sdpa_backends = []
                try:
                    point = take()
                    log(f"{label}: retried with the default SDPA dispatch")
                    fallbacks.append(label)
                except Exception as exc2:
                    log(f"{label}: FAILED again {type(exc2).__name__}: {str(exc2)[:300]}")
                    skipped.append(label)
                    continue
                finally:
                    cal.sdpa_backends = chosen
            writer.writerow(asdict(point))
            fh.flush()
            log(
                f"{label}: {point.median_s * 1e3:.3f} ms (p20 {point.p20_s * 1e3:.3f}, "
                f"p80 {point.p80_s * 1e3:.3f}, {point.reps} reps)"
            )
    if skipped:
        log(f"skipped {len(skipped)} configurations (budget or failure): {', '.join(skipped[:20])}")
    stack["skipped"] = skipped
    stack["sdpa_default_dispatch_for"] = fallbacks
    stack["elapsed_s"] = round(time.monotonic() - started, 1)
    stack_path.write_text(json.dumps(stack, indent=2) + "\n")
    profile = build_profile(read_points(points_path), stack, name=name, date=stack["date"][:10])
    problems = profile_problems(profile)
    if problems:
        raise click.ClickException("the fitted profile does not validate: " + "; ".join(problems))
    (out / f"{name}.json").write_text(json.dumps(profile, indent=2) + "\n")
    return profile


@click.command()
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Folder to write NAME.json, NAME.points.csv and NAME.stack.json into.",
)
@click.option("--name", default="h200-llama3.1-8b", show_default=True, help="Profile name (file stem).")
@click.option("--device", default="cuda", show_default=True, help="torch device to time on.")
@click.option(
    "--tiny", is_flag=True, help="Tiny shapes and grid: a dry run of the whole script (works on CPU)."
)
@click.option(
    "--budget-s",
    type=float,
    default=420.0,
    show_default=True,
    help="Stop taking new measurements after this many seconds and fit what was measured.",
)
@click.option(
    "--refit",
    is_flag=True,
    help="Measure nothing: refit NAME.json from NAME.points.csv and NAME.stack.json in --out.",
)
def main(out: Path, name: str, device: str, tiny: bool, budget_s: float, refit: bool) -> None:
    """Time Llama-3.1-8B-shaped forward passes on this GPU and fit a simulator cost profile."""

    def log(msg: str) -> None:
        click.echo(msg)
        sys.stdout.flush()

    if refit:
        points_path, stack_path = out / f"{name}.points.csv", out / f"{name}.stack.json"
        if not points_path.exists() or not stack_path.exists():
            raise click.ClickException(f"--refit needs {points_path} and {stack_path}")
        stack = json.loads(stack_path.read_text())
        profile = build_profile(
            read_points(points_path), stack, name=name, date=str(stack.get("date", ""))[:10]
        )
        (out / f"{name}.json").write_text(json.dumps(profile, indent=2) + "\n")
    else:
        # Before torch initialises CUDA: large caches and many graph pools fragment less this way.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        try:
            import torch
        except ImportError as exc:
            raise click.ClickException(
                "calibration needs PyTorch (pip install torch) on the GPU machine"
            ) from exc
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise click.ClickException("no CUDA device is visible; use --device cpu --tiny for a dry run")
        profile = run_calibration(out, name, device, tiny, budget_s, log)
    log(json.dumps(profile, indent=2))


if __name__ == "__main__":
    main()

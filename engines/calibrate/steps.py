"""The forward passes a calibration times, built on random weights: a Llama layer's work around
attention as plain torch functions (fused by torch.compile when asked), the target and draft model
steps, the EAGLE heads' drafting, prefill chunks and the target's weight GEMMs alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specproxy.engines.calibrate.shapes import DecoderShape, EagleShape, Grid, eagle_shapes


def layer_functions(s: DecoderShape) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A Llama layer's work before attention (norm, QKV, rotary, GQA fold) and after it (unfold,
    output projection, residual, norm, SwiGLU MLP, residual), as plain
    torch functions that torch.compile can fuse the way vLLM's compiled model is fused.

    pre(layer_in [T, d_in], ln1, wqkv, cos [n, hd/2], sin) -> (q folded [b, kv_heads, g*n, hd],
    new K/V [b, 2*kv_heads, n, hd]); post(x [T, hidden], o, wo, ln2, wgu, wdown) -> x.
    The g query heads that share a KV head are folded into the query length, so attention reads
    each KV head once (the GQA trick of flash-decoding), and no mask is needed: the n new tokens
    attend to all cached keys and to each other, which costs the same as the causal mask among
    them to within n^2 of ctx*n.
    """
    import torch

    f = torch.nn.functional
    qh, kvh, hd = s.q_heads, s.kv_heads, s.head_dim
    g, half = qh // kvh, hd // 2

    def pre(layer_in: Any, ln1: Any, wqkv: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
        n = cos.shape[0]
        b = layer_in.shape[0] // n
        qkv = f.linear(f.rms_norm(layer_in, (layer_in.shape[-1],), ln1, 1e-5), wqkv)
        qk = qkv[:, : (qh + kvh) * hd].reshape(b, n, qh + kvh, hd)
        x1, x2 = qk[..., :half], qk[..., half:]
        # cos/sin arrive as [n, hd/2]: the head axis is added here, a literal 1 that broadcasts
        # even when sizes of 1 are not specialised by the compiler.
        cos, sin = cos[:, None, :], sin[:, None, :]
        qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        qf = qk[:, :, :qh].reshape(b, n, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * n, hd)
        v = qkv[:, (qh + kvh) * hd :].reshape(b, n, kvh, hd)
        kv_new = torch.cat((qk[:, :, qh:], v), dim=2).transpose(1, 2)
        return qf, kv_new

    def post(x: Any, o: Any, wo: Any, ln2: Any, wgu: Any, wdown: Any) -> Any:
        b, m = o.shape[0], o.shape[2]
        n = m // g
        o = o.reshape(b, kvh, g, n, hd).permute(0, 3, 1, 2, 4).reshape(b * n, qh * hd)
        x = x + f.linear(o, wo)
        gate, up = f.linear(f.rms_norm(x, (x.shape[-1],), ln2, 1e-5), wgu).chunk(2, dim=-1)
        return x + f.linear(f.silu(gate) * up, wdown)

    return pre, post


class ModelSteps:
    """The models on random weights of the real shapes, their KV caches, and each timed thing as a
    zero-argument step function (the module docstring says which); the SDPA backends and whether the
    layers are compiled are the measurer's to set (:class:`~specproxy.engines.calibrate.measure.
    Calibrator`). torch is imported here, lazily, on construction."""

    def __init__(
        self,
        device: str,
        target: DecoderShape,
        draft: DecoderShape,
        grid: Grid,
        tiny: bool,
        fused: bool = True,
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
        self.fused = fused
        self._compiled: dict[DecoderShape, tuple[Callable[..., Any], Callable[..., Any]]] = {}
        self.sm_count = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if self.cuda else 8
        )
        self.max_first_compile_s = 120.0
        torch.manual_seed(0)
        self.target = self._decoder_weights(target)
        self.draft = self._decoder_weights(draft)
        self.eagles = {e.name: (e, self._eagle_weights(target, e)) for e in eagle_shapes(target, tiny)}
        configs = grid.target_configs()
        max_q, max_k = max(grid.query_tokens), max(grid.draft_ks)
        # One flat buffer per model, viewed per layer as [B, 2 x kv_heads, ctx+q, head_dim]
        # (each request's K heads, then its V heads) for each configuration; random, never zeros.
        target_tokens = max(b * (c + max_q) for b, _, c in configs)
        self.target_cache = self._cache(target, target_tokens)
        self.draft_cache = self._cache(draft, max(b * (c + 1) for b, _, c in configs))
        eagle_layer = DecoderShape(1, target.hidden, target.q_heads, target.kv_heads, target.head_dim, 1, 1)
        self.eagle_cache = self._cache(eagle_layer, max(b * (c + 2 * max_k + 1) for b, _, c in configs))
        # SDPA backends for batch x heads up to / over the multiprocessor count (empty: torch's own).
        self.sdpa_small: list[Any] = []
        self.sdpa_large: list[Any] = []

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
            s.layers, tokens * 2 * s.kv_heads * s.head_dim, device=self.device, dtype=self.dtype
        )
        return buf.normal_()

    def weight_bytes_read_per_step(self) -> int:
        """Bytes of target weights a decode step reads: every layer and the LM head (the embedding
        table is only gathered, a few rows)."""
        s = self.target_shape
        return int((s.layers * s.layer_params() + s.vocab * s.hidden) * self.dtype.itemsize)

    # building blocks -----------------------------------------------------------------------
    def _rms_norm(self, x: Any, w: Any) -> Any:
        return self.torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-5)

    def _rope_tables(self, s: DecoderShape, start: int, length: int) -> tuple[Any, Any]:
        torch = self.torch
        half = s.head_dim // 2
        inv = 1.0 / (500000.0 ** (torch.arange(half, device=self.device, dtype=torch.float32) / half))
        pos = torch.arange(start, start + length, device=self.device, dtype=torch.float32)
        ang = torch.outer(pos, inv)
        return ang.cos().to(self.dtype), ang.sin().to(self.dtype)

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        # x: [B, q, heads, head_dim]; cos/sin: [q, head_dim/2]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        cos, sin = cos[:, None, :], sin[:, None, :]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _sdpa(self, q: Any, k: Any, v: Any, causal: bool = False) -> Any:
        """torch's fused attention with the backend chosen for this batch class (see
        `choose_sdpa_backend`): batch x heads up to the multiprocessor count is "small"."""
        f = self.torch.nn.functional
        small = q.shape[0] * q.shape[1] <= self.sm_count
        backends = self.sdpa_small if small else self.sdpa_large
        if backends:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(backends):
                return f.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return f.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def _attend(self, s: DecoderShape, qf: Any, kvc: Any) -> Any:
        """qf [b, kv_heads, g*n, hd] over the cache kvc [b, 2*kv_heads, L, hd] (each request's K
        heads, then its V heads)."""
        return self._sdpa(qf, kvc[:, : s.kv_heads], kvc[:, s.kv_heads :])

    def _layer_fns(self, s: DecoderShape) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The layer's work before and after attention, compiled (fused) when `self.fused`; one
        compiled pair per shape, dynamic in batch and tokens."""
        if not self.fused:
            return layer_functions(s)
        if s not in self._compiled:
            pre, post = layer_functions(s)
            compile_ = self.torch.compile
            self._compiled[s] = (
                compile_(pre, dynamic=True, fullgraph=True),
                compile_(post, dynamic=True, fullgraph=True),
            )
        return self._compiled[s]

    def _decoder_layer(
        self,
        s: DecoderShape,
        w: dict[str, Any],
        x: Any,
        layer_in: Any,
        kvc: Any,
        at: int,
        rope: tuple[Any, Any],
    ) -> Any:
        """One pre-norm Llama layer over the tokens of layer_in (b requests x n, n = len(rope)),
        writing their K/V into kvc at positions at..at+n-1 and attending over all of kvc."""
        pre, post = self._layer_fns(s)
        n = rope[0].shape[0]
        qf, kv_new = pre(layer_in, w["ln1"], w["wqkv"], rope[0], rope[1])
        kvc[:, :, at : at + n].copy_(kv_new)
        o = self._attend(s, qf, kvc)
        return post(x, o, w["wo"], w["ln2"], w["wgu"], w["wdown"])

    def _cache_view(self, s: DecoderShape, buf: Any, layer: int, b: int, length: int) -> Any:
        n = b * 2 * s.kv_heads * length * s.head_dim
        return buf[layer, :n].view(b, 2 * s.kv_heads, length, s.head_dim)

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
        length = ctx + n
        caches = [self._cache_view(s, buf, i, b, length) for i in range(s.layers)]

        def step() -> Any:
            x = f.embedding(tokens, w["embed"])
            for i, lw in enumerate(w["layers"]):
                x = self._decoder_layer(s, lw, x, x, caches[i], ctx, rope)
            return f.linear(self._rms_norm(x, w["norm"]), w["lm_head"]).argmax(-1)

        return step

    def gemm_only_step(self, b: int) -> Callable[[], Any]:
        """Only the target's weight GEMMs for b tokens (every layer's four and the LM head): how
        close the matrix kernels alone come to the weight-read floor."""
        f = self.torch.nn.functional
        s, w = self.target_shape, self.target
        x = self._rand(b, s.hidden, std=1.0)
        xm = self._rand(b, s.mlp, std=1.0)

        def step() -> Any:
            for lw in w["layers"]:
                f.linear(x, lw["wqkv"])
                f.linear(x, lw["wo"])
                f.linear(x, lw["wgu"])
                f.linear(xm, lw["wdown"])
            return f.linear(x, w["lm_head"])

        return step

    def eagle_step(self, name: str, b: int, k: int, ctx: int) -> Callable[[], Any]:
        """Draft k tokens for b requests: the first pass runs over the b*(k+1) tokens the last
        verification scored, the next k-1 over b tokens each (chain drafting, as vLLM does).

        EAGLE3 applies its fc once, to the three target hidden states, and its layer attends over
        [embedding; hidden]; EAGLE-1 applies its fc to [embedding; hidden] on every pass. Every pass
        attends over the whole draft cache (ctx+2k+1 keys), a few more than its exact prefix."""
        torch, f = self.torch, self.torch.nn.functional
        s = self.target_shape
        e, w = self.eagles[name]
        fc_once = e.fc_inputs == 3
        n0 = k + 1
        hidden_in = self._rand(b * n0, (e.fc_inputs if fc_once else 1) * s.hidden, std=1.0)
        tokens = torch.randint(0, s.vocab, (b * n0,), device=self.device)
        length = ctx + n0 + k
        kvc = self._cache_view(s, self.eagle_cache, 0, b, length)
        ropes = [self._rope_tables(s, ctx, n0)] + [
            self._rope_tables(s, ctx + n0 + i, 1) for i in range(k - 1)
        ]
        embed = self.target["embed"]  # EAGLE heads share the target's embedding table

        def one_pass(h_prev: Any, tok: Any, at: int, rope: tuple[Any, Any]) -> Any:
            emb = f.embedding(tok, embed)
            if fc_once:
                x, layer_in = h_prev, torch.cat((emb, h_prev), dim=-1)
            else:
                x = f.linear(torch.cat((emb, h_prev), dim=-1), w["fc"])
                layer_in = x
            return self._decoder_layer(s, w["layer"], x, layer_in, kvc, at, rope)

        def step() -> Any:
            h0 = f.linear(hidden_in, w["fc"]) if fc_once else hidden_in
            last = one_pass(h0, tokens, ctx, ropes[0]).view(b, n0, s.hidden)[:, -1]
            tok = f.linear(self._rms_norm(last, w["norm"]), w["lm_head"]).argmax(-1)
            drafted = [tok]
            for i in range(k - 1):
                last = one_pass(last, tok, ctx + n0 + i, ropes[i + 1])
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

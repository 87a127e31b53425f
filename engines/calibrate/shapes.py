"""What a calibration times: the decoder shapes (the Llama-3.1-8B target, the Llama-3.2-1B draft
model, the EAGLE heads on the target) and the grid of batch, query tokens and context; tiny ones for
a CPU dry run."""

from __future__ import annotations

from dataclasses import dataclass

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

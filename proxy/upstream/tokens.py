"""How many tokens a response held, and where that number came from.

A span's ``completion_tokens`` is one of these, best first (``tokens_source`` names it):

- ``usage``: the backend's own count (the final ``usage``, continuous usage, the token ids it returned,
  or an engine's own report such as llama.cpp's ``timings.predicted_n``). Exact.
- ``tokenizer``: the output text encoded with the model's tokenizer (a ``tokenizer.json`` given per arm
  or per experiment, loaded offline with the ``tokenizers`` package, or a ``.gguf`` model's vocabulary
  through llama-cpp-python), plus the end token when the
  engine stopped on one. Exact but for the rare text whose re-encoding differs from the ids the model
  generated, and for stop strings.
- ``chunks``: one token per content chunk, used only for an arm whose chunks have been seen to hold one
  token each: a plain (non-speculative) arm whose chunk counts matched its usage on earlier streams.
  A speculative arm sends several tokens per chunk, so its chunks are never counted as tokens.
- ``text_estimate``: :func:`estimate_tokens`, a count of the text's word pieces. An estimate: figures
  built on it (decode speed, throughput, verdicts) carry its error.

Example::

    count = count_completion_tokens(tap, arm, memory, tokenizer=load_tokenizer("tokenizer.json"))
    count.tokens, count.source          # 57, "tokenizer"
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from specproxy.config import Arm
from specproxy.proxy.upstream.sse import CompletionTap
from specproxy.record import TEXT_ESTIMATE_ERROR as TEXT_ESTIMATE_ERROR

TokensSource = Literal["usage", "tokenizer", "chunks", "text_estimate"]

# Word pieces as byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM) pre-split text: an optional space
# and a run of letters, one to three digits, an optional space and a run of punctuation, whitespace.
_PIECES = re.compile(r"'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+")
# Letters per token beyond a word's first, and punctuation characters per token beyond a run's first:
# fitted on Markdown and Python against SmolLM2's byte-level BPE (49k vocabulary), a typical size.
_WORD_CHARS_PER_TOKEN = 5
_PUNCT_CHARS_PER_TOKEN = 3


class TokenEncoder(Protocol):
    """What :func:`count_completion_tokens` needs from a tokenizer: the number of ids for a text."""

    def count(self, text: str) -> int: ...


def estimate_tokens(text: str) -> int:
    """A documented estimate of the tokens in ``text``: one per word piece, more for long pieces.

    Byte-level BPE vocabularies hold most common English words (with their leading space) as one
    token; a longer word splits into about one more token per five letters, a run of punctuation into
    one per three characters, and numbers are split into groups of up to three digits (as Llama 3's
    pre-tokenizer does). See :data:`TEXT_ESTIMATE_ERROR` for how far off it is.
    """
    n = 0
    for piece in _PIECES.findall(text):
        s = piece.strip()
        if not s or s[0].isdigit():
            n += 1
        elif s[0].isalpha():
            n += 1 + (len(s) - 1) // _WORD_CHARS_PER_TOKEN
        else:
            n += 1 + (len(s) - 1) // _PUNCT_CHARS_PER_TOKEN
    return n


class _HFTokenizer:
    __slots__ = ("_tok",)

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer  # the proxy only pays the import when a tokenizer is set

        self._tok = Tokenizer.from_file(str(path))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


class _GGUFTokenizer:
    """A GGUF model's own tokenizer, through llama-cpp-python: its vocabulary only, no weights loaded.

    llama.cpp models ship as one GGUF file and seldom with a tokenizer.json."""

    __slots__ = ("_llm",)

    def __init__(self, path: Path) -> None:
        from llama_cpp import Llama

        self._llm = Llama(model_path=str(path), vocab_only=True, verbose=False)

    def count(self, text: str) -> int:
        return len(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=False))


@functools.lru_cache(maxsize=16)
def load_tokenizer(path: str) -> TokenEncoder:
    """A ``tokenizer.json`` (Hugging Face ``tokenizers`` format) or a ``.gguf`` model's vocabulary
    (needs llama-cpp-python), read from disk once; never downloads.

    Raises OSError when the file is missing and ValueError when it is not a tokenizer."""
    p = Path(path)
    if not p.is_file():
        raise OSError(f"tokenizer file {p} does not exist")
    gguf = p.suffix.lower() == ".gguf"
    try:
        return _GGUFTokenizer(p) if gguf else _HFTokenizer(p)
    except ImportError as exc:
        needs = "llama-cpp-python (specproxy[llamacpp])" if gguf else "tokenizers (specproxy[tokenizers])"
        raise ValueError(f"reading {p}'s tokenizer needs {needs}: {exc}") from exc
    except Exception as exc:  # tokenizers and llama_cpp raise their own Exception subclasses
        raise ValueError(f"{p} is not a {'GGUF model' if gguf else 'tokenizer.json'}: {exc}") from exc


@dataclass(slots=True)
class ChunkEvidence:
    """Per arm URL: do its streamed content chunks hold one token each? Learnt from streams with usage.

    The offset between usage and content chunks is kept per finish reason: an engine counts the end
    token of a stream that stopped (vLLM does) though no text chunk carries it. A plain arm whose
    offset for a finish reason was always the same, 0 or 1, has proven chunks; any other offset (a
    chunk with several tokens) disproves it for good.
    """

    offsets: dict[tuple[str, str], int | None] = field(default_factory=dict)

    def observe(self, arm: Arm, tap: CompletionTap) -> None:
        used = tap.usage_tokens
        if used is None or tap.count_source != "chunks" or not tap.done or arm.spec_method != "none":
            return
        key = (arm.url, tap.finish_reason or "")
        offset = used - tap.content_chunks
        seen = self.offsets.get(key, offset)
        self.offsets[key] = offset if offset == seen and offset in (0, 1) else None

    def count(self, arm: Arm, tap: CompletionTap) -> int | None:
        """The tokens of a stream without usage, when this arm's chunks are proven; else None."""
        if arm.spec_method != "none" or not tap.done:
            return None
        offset = self.offsets.get((arm.url, tap.finish_reason or ""))
        return tap.content_chunks + offset if offset is not None else None


def end_tokens(finish_reason: str | None, engine: str = "unknown") -> int:
    """1 when the engine stopped on an end token it counts: vLLM counts the EOS (or stop_token_ids)
    token that ended generation in ``completion_tokens`` though it adds no text, so the text's
    re-encoding is one short. llama.cpp servers do not count it (llama-cpp-python's usage of a stopped
    answer equals its logprob entries, one per text token). Approximate when the request used stop
    strings (those tokens are counted, their text cut)."""
    return 1 if finish_reason == "stop" and engine != "llamacpp" else 0


@dataclass(frozen=True, slots=True)
class TokenCount:
    tokens: int | None
    source: TokensSource | None


def count_completion_tokens(
    tap: CompletionTap,
    arm: Arm,
    evidence: ChunkEvidence,
    *,
    tokenizer: TokenEncoder | None = None,
    reported: int | None = None,
    complete: bool = True,
    engine: str = "unknown",
) -> TokenCount:
    """The completion tokens of one response and their source (see the module docstring).

    ``reported``: the engine's own count from outside the usage object (llama.cpp's
    ``timings.predicted_n``). ``complete``: the response ended normally, so an empty output is 0
    tokens (an interrupted one with nothing counted stays None). ``engine``: who answered, which
    decides whether an end token is counted (:func:`end_tokens`).
    """
    evidence.observe(arm, tap)
    if tap.usage_tokens is not None:
        return TokenCount(tap.usage_tokens, "usage")
    if tap.has_token_ids or tap.count_source == "continuous_usage":
        return TokenCount(sum(tap.tokens_per_chunk) or len(tap.token_ids), "usage")
    if reported is not None:
        return TokenCount(reported, "usage")
    text = tap.text()
    if not text and not tap.content_chunks:
        # Nothing came out: zero tokens of text (an engine may still have counted an end token).
        ended = complete and (tap.done or tap.finish_reason is not None)
        return TokenCount(0, "text_estimate") if ended else TokenCount(None, None)
    if tokenizer is not None:
        return TokenCount(tokenizer.count(text) + end_tokens(tap.finish_reason, engine), "tokenizer")
    counted = evidence.count(arm, tap)
    if counted is not None:
        return TokenCount(counted, "chunks")
    return TokenCount(estimate_tokens(text), "text_estimate")

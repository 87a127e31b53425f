"""Deterministic "model output": a word-level tokenizer and the target model's greedy token stream.

The simulated target model is a seeded generator keyed by (model, prompt): every server of one model
returns the same tokens for the same prompt at temperature 0, whatever its speculative method. Output
is a mix of novel words (Zipf-distributed, so common bigrams recur as in real text) and spans copied
from the prompt, in a proportion that depends on the workload category: a summary or a code edit
copies much of its prompt, open chat little. That copying is what n-gram speculation finds.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
import zlib
from dataclasses import dataclass

CATEGORIES = ("chat", "summarization", "code_edit", "extraction", "rag_qa")

# Llama-3 special tokens, so prompt_token_ids look like the real chat template's.
BOS_ID = 128000
EOS_ID = 128009  # <|eot_id|>: what Llama-3.1-Instruct ends a turn with
_HEADER_START, _HEADER_END, _DOUBLE_NEWLINE = 128006, 128007, 271
_ROLE_IDS = {"system": 9125, "user": 882, "assistant": 78191, "tool": 14506}

_COMMON = (
    "the of and to a in is that for it as with was on be by this are or at from have an not which but "
    "they you we can all their has more one will there been also were would when its about if into other "
    "some these than so what time only new most may any over such after two first should could between "
    "use used each many then those where both through while because very well how our them same under "
    "model data system value results method first number process work part example order case point "
    "report team user service request response server latency memory batch token cache model output "
    "input update change file function code test error issue support policy market price growth year "
    "company people government city country state water energy study research health patient school "
    "information level group result design cost rate risk plan project question answer document section "
    "make made take taken give given find found know known think thought show shown help need needs want "
    "look looks seem seems keep kept begin began start started run runs turn turned move moved live lived "
    "bring brought write written read provide provided include included continue allow allowed add added "
    "lead led offer offered build built create created consider considered expect expected remain became "
    "reach reached report reported decide decided require required explain explained describe described "
    "small large big long short high low early late new old young good better best great important public "
    "different possible available local national social political economic financial clear simple strong "
    "real whole full free open common recent major main final similar certain specific general particular "
    "people person family child children friend member leader worker customer student teacher doctor "
    "world area region place home room office building road street center community industry business "
    "money budget price income tax bank fund investment account value share stock trade deal contract "
    "day week month time hour minute moment period season history future past present decade century "
    "problem solution idea reason way approach strategy goal effort action step change impact effect "
    "quality quantity amount size range limit level degree percent rate total average number figure "
    "system network platform software hardware server client database query index table record field "
    "function class method module package library version release feature option setting parameter "
    "error bug fix patch test build deploy config log trace metric alert request response endpoint "
    "model training inference dataset evaluation benchmark accuracy throughput latency speed performance "
    "story poem letter email message note summary article paper book chapter page line word sentence "
    "water food energy power oil gas climate weather environment nature land sea river mountain lake "
    "law court judge rule policy rights security safety health care hospital treatment disease study "
    "however therefore although because while since unless until whether either neither both each every "
    "also still already often always never sometimes usually quickly slowly directly especially finally "
    "first second third next last another other same own such only just even much many more most few"
).split()
_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ten",
    "ra",
    "vo",
    "sel",
    "dan",
    "pre",
    "tor",
    "bu",
    "ni",
    "gal",
    "es",
    "mor",
    "ta",
    "fin",
    "ol",
    "rex",
    "um",
    "ca",
    "ber",
    "sti",
    "po",
    "lum",
    "ne",
    "vis",
    "ar",
)


def _build_vocab(size: int = 4096) -> list[str]:
    words = list(dict.fromkeys(_COMMON))
    rng = random.Random(20240917)
    seen = set(words)
    while len(words) < size:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


VOCAB: list[str] = _build_vocab()
_VOCAB_BASE_ID = 1000
_VOCAB_INDEX = {w: i for i, w in enumerate(VOCAB)}
_UNKNOWN_BASE_ID, _UNKNOWN_SPAN = 20000, 100000
_PUNCT = {",": 11, ".": 13, "\n\n": 271, ":": 25}
_ID_TEXT = {11: ",", 13: ".", 271: "\n\n", 25: ":"}

# A 64k-entry table maps a uniform draw to a Zipf(1.0)-distributed word index in O(1).
_ZIPF_TABLE_BITS = 16


def _zipf_table(n: int) -> list[int]:
    weights = [1.0 / (r + 2.7) for r in range(n)]
    total = sum(weights)
    table: list[int] = []
    acc = 0.0
    size = 1 << _ZIPF_TABLE_BITS
    idx = 0
    for slot in range(size):
        target = (slot + 0.5) / size * total
        while acc + weights[idx] < target and idx < n - 1:
            acc += weights[idx]
            idx += 1
        table.append(idx)
    return table


_ZIPF = _zipf_table(len(VOCAB))

_PIECE = re.compile(r"\s*(?:\w+|[^\w\s])|\s+$")
_WORD_CHAR = re.compile(r"\w")


def tokenize(text: str) -> tuple[list[int], list[str]]:
    """Word-level tokens: (ids, pieces) where "".join(pieces) == text (whitespace kept with the word)."""
    ids, pieces = _tokenize_cached(text)
    return list(ids), list(pieces)


# A replay sends the same prompts again and again (every round, every arm); tokenizing one costs about a
# millisecond per few hundred words, and a wave of a few hundred arrivals at once would hold the engine's
# loop for that long and put it behind its clock.
@functools.lru_cache(maxsize=4096)
def _tokenize_cached(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    ids, pieces = _tokenize(text)
    return tuple(ids), tuple(pieces)


def _tokenize(text: str) -> tuple[list[int], list[str]]:
    ids: list[int] = []
    pieces: list[str] = []
    for match in _PIECE.finditer(text):
        piece = match.group(0)
        word = piece.strip()
        if not word:
            if pieces:
                pieces[-1] += piece
            else:
                ids.append(_DOUBLE_NEWLINE)
                pieces.append(piece)
            continue
        index = _VOCAB_INDEX.get(word.lower())
        if index is not None:
            ids.append(_VOCAB_BASE_ID + index)
        elif word in _PUNCT:
            ids.append(_PUNCT[word])
        else:
            ids.append(_UNKNOWN_BASE_ID + zlib.crc32(word.encode()) % _UNKNOWN_SPAN)
        pieces.append(piece)
    return ids, pieces


def _separate(before: list[str], piece: str) -> str:
    """``piece`` as it can follow ``before`` so that the text re-tokenizes into the same tokens.

    A copied word without a leading space ("width" from "area(width") would fuse with a preceding word
    into one unknown word, as a real model never emits; it takes the spaced form instead, as a model
    would (the simulator's ids ignore spacing, so the token is the same). Text that round-trips makes a
    tokenizer's count of a streamed answer equal the engine's.
    """
    if not _WORD_CHAR.match(piece):
        return piece
    for prior in reversed(before):
        if prior:
            return " " + piece if _WORD_CHAR.match(prior[-1]) else piece
    return piece


def _copyable(ids: list[int], pieces: list[str]) -> tuple[list[int], list[str]]:
    """The prompt tokens an answer may copy: all but a whitespace-only message's lone piece, which
    would merge into the next token's leading whitespace."""
    kept = [(i, p) for i, p in zip(ids, pieces, strict=True) if p.strip()]
    return [i for i, _ in kept], [p for _, p in kept]


@dataclass(frozen=True)
class Prompt:
    """A tokenized prompt: template ids for `prompt_token_ids`, and its content for copying."""

    token_ids: list[int]
    content_ids: list[int]
    content_pieces: list[str]
    text: str


def chat_prompt(messages: list[dict[str, str]]) -> Prompt:
    """Llama-3 chat template shape: BOS, then per message a header, content and <|eot_id|>."""
    ids = [BOS_ID]
    content_ids: list[int] = []
    content_pieces: list[str] = []
    texts: list[str] = []
    for message in messages:
        role = message.get("role", "user")
        content = message.get("content") or ""
        mids, mpieces = tokenize(content)
        ids += [_HEADER_START, _ROLE_IDS.get(role, 882), _HEADER_END, _DOUBLE_NEWLINE, *mids, EOS_ID]
        copy_ids, copy_pieces = _copyable(mids, mpieces)
        content_ids += copy_ids
        content_pieces += copy_pieces
        texts.append(f"{role}:{content}")
    ids += [_HEADER_START, _ROLE_IDS["assistant"], _HEADER_END, _DOUBLE_NEWLINE]
    return Prompt(ids, content_ids, content_pieces, "\x00".join(texts))


def completion_prompt(text: str) -> Prompt:
    ids, pieces = tokenize(text)
    return Prompt([BOS_ID, *ids], *_copyable(ids, pieces), text)


def infer_category(text: str) -> str:
    """Guess the workload category from the prompt when no header or field names it."""
    head = text[:4000].lower()
    tail = text[-1500:].lower()
    probe = head + " " + tail
    if "summar" in probe or "tl;dr" in probe or "tldr" in probe:
        return "summarization"
    if "```" in probe or "def " in probe or "refactor" in probe or "function" in probe or "code" in tail:
        return "code_edit"
    if "extract" in probe or "json" in tail or "list all" in probe:
        return "extraction"
    if "context:" in probe or "document" in probe or "passage" in probe or "according to" in probe:
        return "rag_qa"
    return "chat"


@dataclass(frozen=True)
class CopyStyle:
    """How a category's answers are written: share of tokens in copy segments, segment lengths, length."""

    copy_share: float
    copy_mean: float
    novel_mean: float
    length_mean: float
    length_of_prompt: float = 0.0  # answer length grows with the prompt (code edits rewrite the file)


STYLES: dict[str, CopyStyle] = {
    "chat": CopyStyle(copy_share=0.04, copy_mean=4, novel_mean=60, length_mean=280),
    "summarization": CopyStyle(copy_share=0.5, copy_mean=9, novel_mean=9, length_mean=160),
    "code_edit": CopyStyle(copy_share=0.8, copy_mean=30, novel_mean=7, length_mean=120, length_of_prompt=0.8),
    "extraction": CopyStyle(copy_share=0.65, copy_mean=6, novel_mean=3, length_mean=110),
    "rag_qa": CopyStyle(copy_share=0.35, copy_mean=8, novel_mean=14, length_mean=140),
}


def request_key(model: str, prompt_text: str, salt: str = "") -> int:
    """A 64-bit seed for one (model, prompt) pair; `salt` separates sampled (temperature > 0) runs."""
    digest = hashlib.blake2b(f"{model}\x01{prompt_text}\x01{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class TargetText:
    """The target model's token stream for one prompt, generated lazily and deterministically.

    `ids[i]`/`pieces[i]` are the i-th output token. Position `eos_at` holds EOS (the model's natural
    end; with ignore_eos generation goes on past it). Every prompt has one near-tie position
    `tie_at` (top-1 and top-2 logprobs almost equal); a lossy server flips that tie, after which
    the text differs from every lossless server's.
    """

    __slots__ = (
        "ids",
        "pieces",
        "eos_at",
        "tie_at",
        "_rng",
        "_style",
        "_src_ids",
        "_src_pieces",
        "_seg_left",
        "_copy_pos",
        "_last_copy_end",
        "_flip",
        "_key",
        "_prompt",
        "_category",
    )

    def __init__(self, key: int, prompt: Prompt, category: str, *, flip: bool = False) -> None:
        self._key = key
        self._prompt = prompt
        self._category = category
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self._rng = random.Random(key)
        style = STYLES.get(category, STYLES["chat"])
        self._style = style
        self._src_ids = prompt.content_ids
        self._src_pieces = prompt.content_pieces
        mean = style.length_mean + style.length_of_prompt * len(prompt.content_ids)
        # Natural answer length: at least half the category's mean, so short max_tokens always bind.
        self.eos_at = max(int(mean * 0.5), int(self._rng.gauss(mean, mean * 0.35)))
        self.tie_at = self._rng.randint(1, max(1, min(self.eos_at - 1, 200)))
        self._flip = flip
        self._seg_left = 0
        self._copy_pos = -1
        self._last_copy_end = -1

    def ensure(self, n: int) -> None:
        """Generate tokens up to index n-1."""
        ids, pieces, rng = self.ids, self.pieces, self._rng
        src_ids, src_pieces = self._src_ids, self._src_pieces
        while len(ids) < n:
            pos = len(ids)
            if pos == self.eos_at:
                ids.append(EOS_ID)
                pieces.append("")
                continue
            if self._seg_left <= 0:
                self._start_segment(rng)
            self._seg_left -= 1
            if self._copy_pos >= 0:
                ids.append(src_ids[self._copy_pos])
                pieces.append(_separate(pieces, src_pieces[self._copy_pos]))
                self._copy_pos += 1
                if self._copy_pos >= len(src_ids):
                    self._seg_left = 0
                if pos == self.tie_at and self._flip:
                    self._flip_last(pos)
                    rng = self._rng
                continue
            r = rng.random()
            if r < 0.07 and pieces and pieces[-1] not in (",", "."):
                ids.append(11)
                pieces.append(",")
            elif r < 0.13 and pieces and pieces[-1] not in (",", "."):
                ids.append(13)
                pieces.append(".")
            else:
                index = _ZIPF[int(rng.random() * 65536)]
                ids.append(_VOCAB_BASE_ID + index)
                pieces.append(" " + VOCAB[index])
            if pos == self.tie_at and self._flip:
                self._flip_last(pos)
                rng = self._rng

    def _start_segment(self, rng: random.Random) -> None:
        style = self._style
        # Share of *segments* that copy, chosen so the share of *tokens* copied is copy_share.
        s = style.copy_share
        p_copy = s * style.novel_mean / (s * style.novel_mean + (1 - s) * style.copy_mean) if s > 0 else 0.0
        if self._src_ids and rng.random() < p_copy:
            if self._last_copy_end < 0 or rng.random() < 0.3:
                start = rng.randrange(len(self._src_ids))
            else:
                # Summaries and edits mostly walk forward through their source.
                start = (self._last_copy_end + int(rng.expovariate(1.0 / 40))) % len(self._src_ids)
            self._copy_pos = start
            self._seg_left = 1 + int(rng.expovariate(1.0 / style.copy_mean))
        else:
            if self._copy_pos >= 0:
                self._last_copy_end = self._copy_pos
            self._copy_pos = -1
            self._seg_left = 1 + int(rng.expovariate(1.0 / style.novel_mean))

    def _flip_last(self, pos: int) -> None:
        # The near-tie flips: the runner-up replaces the greedy token, and from here the stream differs.
        tid, piece = self.runner_up(pos, self.ids[pos])
        self.ids[pos] = tid
        self.pieces[pos] = piece
        self._rng = random.Random(self._key ^ 0x5DEECE66D)
        self._seg_left = 0
        self._copy_pos = -1

    def runner_up(self, pos: int, greedy_id: int) -> tuple[int, str]:
        """The second-best token at `pos`: a word that differs from the greedy one."""
        index = (self._key + pos * 7919) % 512
        if _VOCAB_BASE_ID + index == greedy_id:
            index = (index + 1) % 512
        return _VOCAB_BASE_ID + index, " " + VOCAB[index]

    def _unflipped_at_tie(self) -> tuple[int, str]:
        clean = TargetText(self._key, self._prompt, self._category)
        clean.ensure(self.tie_at + 1)
        return clean.ids[self.tie_at], clean.pieces[self.tie_at]

    def logprobs(self, pos: int, top: int) -> tuple[float, list[tuple[int, str, float]]]:
        """(chosen logprob, [(id, piece, logprob) of the top `top` alternatives, best first]).

        Greedy picks the top-1, so the chosen token leads the list; at the near-tie position the
        top-2 margin is a few hundredths of a nat.
        """
        rng = random.Random(self._key * 1_000_003 + pos)
        chosen = -rng.random() * 1.2 if pos != self.tie_at else -0.68
        second = chosen - (0.02 if pos == self.tie_at else 0.4 + rng.random() * 2.0)
        alternatives = [(self.ids[pos], self.pieces[pos], chosen)]
        if self._flip and pos == self.tie_at:
            # This server took the runner-up; the greedy token of the lossless servers is the other one.
            ru_id, ru_piece = self._unflipped_at_tie()
        else:
            ru_id, ru_piece = self.runner_up(pos, self.ids[pos])
        alternatives.append((ru_id, ru_piece, second))
        lp = second
        for j in range(2, top):
            lp -= 0.3 + rng.random()
            index = (pos * 31 + j * 97) % len(VOCAB)
            alternatives.append((_VOCAB_BASE_ID + index, " " + VOCAB[index], lp))
        return chosen, alternatives[: max(top, 0)]


def id_text(token_id: int) -> str:
    """Text of a token id the simulator produced (for logprob alternatives and detokenizing)."""
    if token_id in _ID_TEXT:
        return _ID_TEXT[token_id]
    index = token_id - _VOCAB_BASE_ID
    if 0 <= index < len(VOCAB):
        return " " + VOCAB[index]
    return ""

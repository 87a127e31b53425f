"""The simulator's output behaves like a real model's: its text re-tokenizes into the tokens it
generated, so a tokenizer's count of a streamed answer equals the engine's usage."""

from __future__ import annotations

from pathlib import Path

import pytest

from specproxy.engines.sim.text import (
    TargetText,
    chat_prompt,
    completion_prompt,
    infer_category,
    request_key,
    tokenize,
)
from specproxy.engines.sim.tokenizer import write_tokenizer_json
from specproxy.proxy.upstream.tokens import load_tokenizer

# Prompts whose copied spans hold words without a leading space (after "(", at a message's start,
# digits after a letter-free run), unicode, trailing newlines and a whitespace-only message.
MESSAGES = [
    [{"role": "user", "content": "Rewrite this function: def area(width, height): return width*height"}],
    [{"role": "user", "content": "Extract every name and city: Ana lives in Lisbon (2024), Ben in Boston."}],
    [
        {"role": "system", "content": "Summarise tersely.\n"},
        {"role": "user", "content": "Report:cache_hit=0.93"},
    ],
    [
        {"role": "user", "content": "   "},
        {"role": "user", "content": "Summarise: café naïve – 東京 v1.2.3\n\n"},
    ],
    [{"role": "user", "content": "According to the document: x(y)z[w]{v}, foo_bar baz9 9baz."}],
]


def _answers() -> list[TargetText]:
    answers = []
    for i, messages in enumerate(MESSAGES):
        content = " ".join(m["content"] for m in messages)
        for prompt in (chat_prompt(messages), completion_prompt(content)):
            for flip in (False, True):
                target = TargetText(
                    request_key(f"m{i}", prompt.text), prompt, infer_category(content), flip=flip
                )
                target.ensure(target.eos_at)
                answers.append(target)
    return answers


@pytest.mark.parametrize("target", _answers())
def test_an_answers_text_re_tokenizes_into_the_ids_it_was_generated_as(target: TargetText) -> None:
    for end in (1, target.tie_at + 1, target.eos_at):
        text = "".join(target.pieces[:end])
        assert tokenize(text)[0] == target.ids[:end]


def test_the_tokenizer_json_counts_what_the_simulator_generated(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(write_tokenizer_json(tmp_path / "sim.json")))
    for target in _answers():
        text = "".join(target.pieces[: target.eos_at])
        assert tokenizer.count(text) == target.eos_at
    for text in ("", "   ", "word\n", "a  b\n\nc.\n", "x(y)"):
        assert tokenizer.count(text) == len(tokenize(text)[0])

"""The simulator's word-level tokenizer as a ``tokenizer.json``, so a proxy can count its output.

An arm without usage counts tokens with the model's ``tokenizer.json``; pointing it at this file makes
the simulator stand in for a real model there too. One id per piece is all a count needs, so the
vocabulary is empty and every piece is the unknown token; the pre-tokenizer splits text where
:func:`specproxy.engines.sim.text.tokenize` does (a word or one punctuation mark with the whitespace
before it; trailing whitespace stays with the last piece).

Example::

    write_tokenizer_json(Path("sim-tokenizer.json"))
    # [arms.tokenizer] = "sim-tokenizer.json" in an experiment
"""

from __future__ import annotations

from pathlib import Path

# Oniguruma's `$` also matches before a newline; `\z` is the end of the text only.
_SPLIT = r"\s*(?:\w+|[^\w\s])(?:\s+\z)?|\s+"


def write_tokenizer_json(path: Path) -> Path:
    """Write the simulator's tokenizer to ``path`` (Hugging Face ``tokenizers`` format); returns it.
    Needs the tokenizers package (``pip install 'specproxy[tokenizers]'``)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated")
    tok.save(str(path))
    return path

"""Keep what a client sent out of the error texts that spans store (unless capture is on).

An arm's error answer can echo the request: vLLM's validation errors quote the offending input
(``input_value=[{'role': 'user', 'content': 'my secret ...'}]``, long values cut in the middle with
``...``). With capture off the span store must not hold prompt text, so :func:`redact_request_text`
replaces every word of three or more characters that also occurs anywhere in the request's strings (a
word cut short by such an ellipsis is still a piece of one) with ``…``, and cuts the result to
:data:`MAX_ERROR_CHARS`. Words the error shares with the prompt by chance are masked too: the error
loses some words, never the other way round. Shorter words stay (a piece of one-or-two characters
is in almost any prompt, and tells nothing about it).

Example::

    redact_request_text("input_value='call me at 555-0100'", {"prompt": "call me at 555-0100"})
    # "input_value='… me at …-…'"
"""

from __future__ import annotations

import re
from typing import Any

MAX_ERROR_CHARS = 300

_WORD = re.compile(r"\w{3,}")


def redact_request_text(error: str, body: dict[str, Any]) -> str:
    """``error`` without any word found in the request ``body``'s strings, at most MAX_ERROR_CHARS."""
    text = error[: 2 * MAX_ERROR_CHARS]
    haystack = "\n".join(_strings(body))

    def mask(word: re.Match[str]) -> str:
        return "…" if word[0] in haystack else word[0]

    return _WORD.sub(mask, text)[:MAX_ERROR_CHARS] if haystack else text[:MAX_ERROR_CHARS]


def _strings(value: Any) -> list[str]:
    """Every string in parsed JSON (keys included: a client may put content in a key)."""
    out: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            out.extend(k for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return out

"""Random ids for every request (its request id, trace id, span ids) without a system call each.

``os.urandom`` costs a system call per id, three or more per proxied request; here its bytes are drawn
4 KiB at a time and handed out in slices: the same source, so ids stay as unpredictable as before.
A forked child starts on a fresh draw (it must not hand out its parent's bytes again).

>>> len(random_hex(16)), random_hex(8) != random_hex(8)
(32, True)
>>> uuid4_hex()[12], uuid4_hex()[16] in "89ab"
('4', True)
"""

from __future__ import annotations

import os
import threading

_DRAW = 4096


class _RandomBytes:
    __slots__ = ("_lock", "_pool", "_at")

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (the span writer's thread makes ids too)
        self._pool = b""
        self._at = 0

    def take(self, n: int) -> bytes:
        with self._lock:
            at = self._at
            if at + n > len(self._pool):
                self._pool, at = os.urandom(_DRAW), 0
            self._at = at + n
            return self._pool[at : at + n]

    def forget(self) -> None:
        self._pool, self._at = b"", 0
        self._lock = threading.Lock()


_BYTES = _RandomBytes()
os.register_at_fork(after_in_child=_BYTES.forget)


def random_hex(nbytes: int) -> str:
    """``nbytes`` random bytes as lower-case hex (what ``secrets.token_hex(nbytes)`` gives)."""
    return _BYTES.take(nbytes).hex()


# uuid4's fixed bits (RFC 4122): version 4 in bits 76-79, variant 10 in bits 62-63.
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


def uuid4_hex() -> str:
    """A random UUID (version 4) as 32 hex digits (what ``uuid.uuid4().hex`` gives)."""
    value = int.from_bytes(_BYTES.take(16), "big") & _UUID4_CLEAR | _UUID4_SET
    return f"{value:032x}"

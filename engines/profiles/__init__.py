"""Simulator cost profiles: one JSON file per hardware x model, and the step-time formula they feed.

The format is the contract between profiles and the simulator: every time is in seconds;
KV = KV-cache tokens attended over the batch in a step, T = batched tokens in the step (1 per decoding
request, k+1 per verifying request, a prefill chunk's tokens), B = requests in the step.

    step time = step_overhead_s + target(T, KV) + drafter(B, k, KV)   (+ prefill work)

    >>> profile = load_profile("h100-llama3.1-8b")
    >>> round(profile.step_time(batched_tokens=1, kv_tokens=1024) * 1e3, 2)   # one decode step, ms
    7.15
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).resolve().parent
DEFAULT_PROFILE = "h100-llama3.1-8b"

# Methods whose drafter cost is "a small head over the whole batch" (profile keys base/per_kv/per_spec).
HEAD_METHODS = ("eagle", "eagle3", "mtp")
# Methods whose drafter cost is a share of the verification forward (CPU-side lookups).
LOOKUP_METHODS = ("ngram", "suffix")


class ProfileError(ValueError):
    """A profile name that does not resolve to a file, or a file that breaks the format."""


@dataclass(frozen=True)
class Forward:
    """One forward pass of a model over the batch: flat below the knee (memory-bound), then linear."""

    base_s: float
    per_kv_token_s: float
    per_batched_token_s: float
    knee_batched_tokens: int = 0

    def time(self, batched_tokens: int, kv_tokens: int) -> float:
        over_knee = batched_tokens - self.knee_batched_tokens
        return (
            self.base_s
            + self.per_kv_token_s * kv_tokens
            + (self.per_batched_token_s * over_knee if over_knee > 0 else 0.0)
        )


@dataclass(frozen=True)
class HeadDrafter:
    """EAGLE/MTP-style heads: drafting all k tokens for the whole batch in one step."""

    base_s: float
    per_kv_token_s: float
    per_spec_token_s: float

    def time(self, requests: int, k: int, kv_tokens: int) -> float:
        return self.base_s + self.per_kv_token_s * kv_tokens + self.per_spec_token_s * requests * k


@dataclass(frozen=True)
class Prefill:
    base_s: float
    per_token_s: float


@dataclass(frozen=True)
class CostProfile:
    name: str
    hardware: str
    model: str
    source: str
    step_overhead_s: float
    target: Forward
    head_drafters: dict[str, HeadDrafter] = field(default_factory=dict)
    draft_model: Forward | None = None
    lookup_fractions: dict[str, float] = field(default_factory=dict)
    prefill: Prefill | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_cache_tokens: int = 442_368
    fit: dict[str, Any] | None = None
    path: str = ""

    def supports(self, method: str) -> bool:
        if method in HEAD_METHODS:
            return method in self.head_drafters or "eagle" in self.head_drafters
        if method == "draft_model":
            return self.draft_model is not None
        if method in LOOKUP_METHODS:
            return True
        return False

    def drafter_time(self, method: str, requests: int, k: int, kv_tokens: int, verify_s: float) -> float:
        """Cost of proposing k tokens for `requests` requests in one step (0 when nobody drafts)."""
        if requests <= 0 or k <= 0:
            return 0.0
        if method in HEAD_METHODS:
            head = self.head_drafters.get(method) or self.head_drafters["eagle"]
            return head.time(requests, k, kv_tokens)
        if method == "draft_model":
            assert self.draft_model is not None
            # A chain of k sequential small-model forwards, each over the drafting requests (T = B).
            return k * self.draft_model.time(requests, kv_tokens)
        if method in LOOKUP_METHODS:
            return self.lookup_fractions.get(method, 0.0) * verify_s
        return 0.0

    def step_time(
        self,
        batched_tokens: int,
        kv_tokens: int,
        *,
        prefill_tokens: int = 0,
        method: str | None = None,
        drafting_requests: int = 0,
        k: int = 0,
    ) -> float:
        """Seconds one engine step takes.

        `batched_tokens` counts every token in the step, prefill chunks included; when the profile
        has a separate `prefill` model those tokens are charged there instead of in the target forward.
        """
        decode_tokens = batched_tokens
        extra = 0.0
        if self.prefill is not None and prefill_tokens > 0:
            decode_tokens -= prefill_tokens
            extra = self.prefill.base_s + self.prefill.per_token_s * prefill_tokens
        verify_s = self.target.time(decode_tokens, kv_tokens) if decode_tokens > 0 else 0.0
        draft_s = 0.0
        if method is not None:
            draft_s = self.drafter_time(method, drafting_requests, k, kv_tokens, verify_s)
        return self.step_overhead_s + verify_s + draft_s + extra


def profile_names() -> list[str]:
    """Names of the profiles shipped in engines/profiles (without `.json`), sorted."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json") if not p.name.endswith(".stack.json"))


def load_profile(name_or_path: str) -> CostProfile:
    """Load `engines/profiles/NAME.json`, or a JSON file at a path."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".json" or candidate.exists():
        path = candidate
    else:
        path = PROFILE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = ", ".join(profile_names()) or "none"
        raise ProfileError(
            f"no cost profile '{name_or_path}' (known profiles: {known}; or give a .json path)"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read cost profile {path}: {exc}") from exc
    try:
        return _parse(raw, str(path))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"cost profile {path} does not follow the profile format: {exc!r}") from exc


def _default_kv_tokens(hardware: str) -> int:
    """KV-cache tokens when a profile's limits do not say (optional `limits.kv_cache_tokens`).

    vLLM's default 90 % of GPU memory, minus 16 GB of bf16 Llama-3.1-8B weights and ~2 GB of
    activations, at 128 KiB of KV per token: H100 80 GB -> ~440k tokens, H200 141 GB -> ~890k.
    """
    gib = 141 if "H200" in hardware.upper() else 80
    return int((gib * 0.9 - 18) * 2**30 / (128 * 1024))


def _forward(raw: dict[str, Any]) -> Forward:
    return Forward(
        base_s=float(raw["base_s"]),
        per_kv_token_s=float(raw.get("per_kv_token_s", 0.0)),
        per_batched_token_s=float(raw.get("per_batched_token_s", 0.0)),
        knee_batched_tokens=int(raw.get("knee_batched_tokens", 0)),
    )


def _parse(raw: dict[str, Any], path: str) -> CostProfile:
    drafters: dict[str, Any] = raw.get("drafters", {})
    heads = {
        name: HeadDrafter(
            base_s=float(d["base_s"]),
            per_kv_token_s=float(d.get("per_kv_token_s", 0.0)),
            per_spec_token_s=float(d.get("per_spec_token_s", 0.0)),
        )
        for name, d in drafters.items()
        if name in HEAD_METHODS
    }
    lookups = {name: float(d["fraction_of_verify"]) for name, d in drafters.items() if name in LOOKUP_METHODS}
    prefill_raw = raw.get("prefill")
    limits = raw.get("limits", {})
    return CostProfile(
        name=str(raw["name"]),
        hardware=str(raw.get("hardware", "")),
        model=str(raw.get("model", "")),
        source=str(raw.get("source", "")),
        step_overhead_s=float(raw["step_overhead_s"]),
        target=_forward(raw["target"]),
        head_drafters=heads,
        draft_model=_forward(drafters["draft_model"]) if "draft_model" in drafters else None,
        lookup_fractions=lookups,
        prefill=(
            Prefill(float(prefill_raw["base_s"]), float(prefill_raw["per_token_s"])) if prefill_raw else None
        ),
        max_num_seqs=int(limits.get("max_num_seqs", 256)),
        max_num_batched_tokens=int(limits.get("max_num_batched_tokens", 8192)),
        kv_cache_tokens=int(
            limits.get("kv_cache_tokens") or _default_kv_tokens(str(raw.get("hardware", "")))
        ),
        fit=raw.get("fit"),
        path=path,
    )

"""The simulator's settings: a frozen `SimConfig`, and vLLM's `--speculative-config` JSON parsed."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "suffix")
# vLLM methods the simulator does not model; named so the error can say so instead of "unknown".
_UNMODELLED = ("dflash", "ngram_gpu", "dspark", "custom_class", "extract_hidden_states")
SPEC_METRICS_LEVELS = ("none", "summary", "detailed")


class SimConfigError(ValueError):
    """A setting the simulator cannot run with; the message is a sentence for the user."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative config, the keys the simulator uses (others are kept in `raw`)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    # vLLM's testing knob: force a per-token acceptance rate (the simulator's "fixed alpha").
    synthetic_acceptance_rate: float | None = None
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SimConfigError(f"--speculative-config is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise SimConfigError(
                "--speculative-config must be a JSON object such as "
                '{"method": "ngram", "num_speculative_tokens": 4}'
            )
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        method = raw.get("method")
        if method is None:
            # vLLM infers the method from the draft model name; without one n-gram is the only choice.
            model = str(raw.get("model") or "")
            lowered = model.lower()
            if "eagle3" in lowered:
                method = "eagle3"
            elif "eagle" in lowered:
                method = "eagle"
            elif model:
                method = "draft_model"
            else:
                raise SimConfigError(
                    "--speculative-config needs a 'method' (one of " + ", ".join(SPEC_METHODS) + ")"
                )
        if method in _UNMODELLED:
            raise SimConfigError(
                f"speculative method '{method}' is valid in vLLM but not modelled by the "
                f"simulator; use one of {', '.join(SPEC_METHODS)}"
            )
        if method not in SPEC_METHODS:
            raise SimConfigError(
                f"unknown speculative method '{method}'; use one of {', '.join(SPEC_METHODS)}"
            )
        k = raw.get("num_speculative_tokens")
        if k is None:
            if method == "mtp":
                k = 1
            else:
                raise SimConfigError(f"--speculative-config for '{method}' needs num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise SimConfigError(f"num_speculative_tokens must be a positive integer, got {k!r}")
        if method == "draft_model" and not raw.get("model"):
            raise SimConfigError("speculative method 'draft_model' needs a 'model' (the small draft model)")
        lo = raw.get("prompt_lookup_min")
        hi = raw.get("prompt_lookup_max")
        # vLLM: both default to 5; one given copies to the other; min <= max.
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (lo, hi)):
            raise SimConfigError("prompt_lookup_min and prompt_lookup_max must be positive integers")
        assert isinstance(lo, int) and isinstance(hi, int)
        if lo > hi:
            raise SimConfigError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        rate = raw.get("synthetic_acceptance_rate")
        rates = raw.get("synthetic_acceptance_rates")
        for value in ([rate] if rate is not None else []) + list(rates or []):
            if not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
                raise SimConfigError(f"synthetic acceptance rates must lie in [0, 1], got {value!r}")
        return cls(
            method=str(method),
            num_speculative_tokens=k,
            prompt_lookup_min=lo,
            prompt_lookup_max=hi,
            model=raw.get("model"),
            suffix_decoding_max_tree_depth=int(raw.get("suffix_decoding_max_tree_depth", 24)),
            synthetic_acceptance_rate=float(rate) if rate is not None else None,
            synthetic_acceptance_rates=tuple(float(r) for r in rates) if rates else None,
            raw=dict(raw),
        )


@dataclass(frozen=True)
class Faults:
    """Ways to break the simulator on purpose; all off by default."""

    lossy_rate: float = 0.0
    error_rate: float = 0.0
    stall_ms: float = 0.0
    drop_rate: float = 0.0
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        for name in ("lossy_rate", "error_rate", "drop_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise SimConfigError(f"--{name.replace('_', '-')} must lie in [0, 1], got {value}")
        if self.stall_ms < 0:
            raise SimConfigError(f"--stall-ms must be >= 0, got {self.stall_ms}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise SimConfigError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulated vLLM server needs. `speculative=None` is plain decoding."""

    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    served_model_name: str | None = None
    speculative: SpeculativeConfig | None = None
    profile: str = "h100-llama3.1-8b"
    time_scale: float = 1.0
    seed: int = 0
    per_request_spec_decode_metrics: str = "none"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int = 131072
    # vLLM V1 caches prompt prefixes by default (--enable-prefix-caching).
    enable_prefix_caching: bool = True
    # KV-cache capacity in tokens (None: the profile's); beyond it requests wait or are preempted.
    kv_cache_tokens: int | None = None
    faults: Faults = field(default_factory=Faults)
    # Finished requests kept for GET /sim/requests (oldest dropped first).
    keep_finished: int = 100_000

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise SimConfigError(f"--time-scale must be > 0, got {self.time_scale}")
        if self.per_request_spec_decode_metrics not in SPEC_METRICS_LEVELS:
            raise SimConfigError("--per-request-spec-decode-metrics must be one of none, summary, detailed")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SimConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def method(self) -> str | None:
        return self.speculative.method if self.speculative else None

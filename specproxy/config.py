"""The experiment file: TOML in, typed frozen config out.

    [experiment]            name, mode (shadow | split), db, model, the operating point
                            (at_concurrency, peak_concurrency, at_rate, peak_rate) and proxy settings
    [slo]                   optional latency targets (ttft_p95 = "500ms", itl_p99 = "80ms", ...):
                            goodput, capacity at the SLO and the fleet at the peak (peak_rate,
                            gpu_hour_usd in [experiment]); see specproxy/slo.py
    [[arms]]                one per backend, each with a role:
                              "baseline"   exactly one: the configuration candidates are measured against
                              "candidate"  (the default) a configuration under test
                              "replica"    any number: a plain copy of the baseline (no speculation),
                                           measured like a candidate; its spread against the baseline
                                           is the noise floor a real difference must clear

A mistake raises :class:`ConfigError` whose message names the file, the arm and the field, e.g.
``exp.toml: arms[2].speculative.num_speculative_tokens: must be ≥ 1``.

Example::

    cfg = load_experiment("exp.toml")
    cfg.baseline.url, [a.name for a in cfg.candidates]
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from specproxy.slo import Slo, SloError, slo_from_table

Mode = Literal["shadow", "split"]
Role = Literal["baseline", "candidate", "replica"]
ROLES: tuple[Role, ...] = ("baseline", "candidate", "replica")

# vLLM 0.33's `method` values (vllm/config/speculative.py).
SPEC_METHODS = frozenset(
    {
        "ngram",
        "draft_model",
        "suffix",
        "eagle",
        "eagle3",
        "mtp",
        "dflash",
        "ngram_gpu",
        "dspark",
        "custom_class",
        "extract_hidden_states",
    }
)
REMOVED_SPEC_METHODS = frozenset({"medusa", "mlp_speculator"})
# The serving engines whose responses the proxy reads; "auto" detects it from what the arm returns.
ENGINE_KINDS = ("auto", "vllm", "sglang", "trtllm", "llamacpp")


class ConfigError(ValueError):
    """The experiment file is missing, unreadable or invalid; the message says where and why."""


@dataclass(frozen=True)
class EngineSettings:
    """How `specproxy engines` launches this arm's vLLM (ignored by the proxy)."""

    port: int | None = None
    gpus: tuple[int, ...] = ()
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Arm:
    name: str
    url: str
    role: Role = "candidate"
    weight: float = 1.0
    # Exactly vLLM's --speculative-config JSON; empty means no speculation.
    speculative: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # Shadow mode: share of requests mirrored to this candidate (0..1).
    sample: float = 1.0
    # Shadow mode: at most this many mirrored calls in flight; over it the copy is dropped.
    max_shadow_inflight: int = 64
    # Engines behind this arm's URL sharing its calls evenly (a load-balanced service): each engine's
    # load is the arm's in-flight count divided by it, for the comparison at matched load.
    replicas_behind_url: int = 1
    # Name of an environment variable holding this arm's upstream API key (never the key itself).
    api_key_env: str | None = None
    # Send vLLM's extensions (stream_options.continuous_usage_stats, return_token_ids)?
    # "auto" sends them; a backend that rejects them is retried without and remembered.
    vllm_extensions: Literal["auto", "on", "off"] = "auto"
    return_token_ids: bool = False
    description: str = ""
    engine: EngineSettings = field(default_factory=EngineSettings)
    # Which engine serves this arm (`engine = "llamacpp"`, or `kind` in the [arms.engine] table).
    engine_kind: str = "auto"
    # A tokenizer.json to count output tokens with when the arm reports no usage (else the
    # experiment's `tokenizer`); read from disk, never downloaded.
    tokenizer: str | None = None

    @property
    def spec_method(self) -> str:
        """`none` when the arm runs without speculation."""
        return str(self.speculative.get("method", "none")) if self.speculative else "none"

    @property
    def num_speculative_tokens(self) -> int | None:
        k = self.speculative.get("num_speculative_tokens") if self.speculative else None
        return int(k) if k is not None else None

    @property
    def speculative_json(self) -> str:
        return json.dumps(dict(self.speculative), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Experiment:
    name: str
    arms: tuple[Arm, ...]
    mode: Mode = "shadow"
    db: str = "specproxy.duckdb"
    model: str | None = None
    description: str = ""
    # Split mode stickiness: "" (none), "user" (the body's user field) or "header:X-Session-ID".
    sticky_key: str = ""
    # Split mode: share of greedy requests routed to a candidate that are also sent to the baseline.
    verify_fraction: float = 0.0
    # Timeouts (seconds). None = no limit on the whole call; generations can be long.
    upstream_connect_timeout_s: float = 10.0
    upstream_read_timeout_s: float | None = 600.0
    shadow_timeout_s: float = 600.0
    max_body_bytes: int = 32 * 1024 * 1024
    # Clients: a request head must arrive within client_header_timeout_s of the connection opening (or
    # of its previous response), its body within client_body_timeout_s; None: from the file limit.
    client_header_timeout_s: float = 30.0
    client_body_timeout_s: float = 60.0
    max_client_connections: int | None = None
    shutdown_grace_s: float = 30.0
    span_queue_size: int = 100_000
    scrape_interval_s: float = 5.0
    otlp_endpoint: str | None = None
    source_path: str | None = None
    # The default tokenizer.json for arms that name none (see Arm.tokenizer).
    tokenizer: str | None = None
    # The operating point: the concurrency the user runs at, and their peak. The deploy verdict is
    # answered at these levels; None: the analysis says what it assumed.
    at_concurrency: int | None = None
    peak_concurrency: int | None = None
    # The same for a sweep of request rates (replay --rates), in requests/s.
    at_rate: float | None = None
    peak_rate: float | None = None
    # The latency SLO ([slo]) and the price of a GPU-hour: the analysis sizes each arm's fleet at the
    # peak (peak_concurrency or peak_rate) from its capacity at the SLO.
    slo: Slo | None = None
    gpu_hour_usd: float | None = None

    @property
    def baseline(self) -> Arm:
        return next(a for a in self.arms if a.role == "baseline")

    @property
    def candidates(self) -> tuple[Arm, ...]:
        """Every arm but the baseline (replicas included: they are called the way candidates are)."""
        return tuple(a for a in self.arms if a.role != "baseline")

    @property
    def replicas(self) -> tuple[Arm, ...]:
        return tuple(a for a in self.arms if a.role == "replica")

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise KeyError(name)


class _Reader:
    """Pulls typed fields out of one TOML table, naming the path on every mistake."""

    def __init__(self, where: str, table: Mapping[str, Any], path: str) -> None:
        self.where = where
        self.table = table
        self.path = path
        self.used: set[str] = set()

    def fail(self, key: str, msg: str) -> ConfigError:
        prefix = f"{self.path}." if self.path else ""
        return ConfigError(f"{self.where}: {prefix}{key}: {msg}")

    def get(
        self, key: str, kind: type | tuple[type, ...], default: Any = ..., *, required: bool = False
    ) -> Any:
        self.used.add(key)
        if key not in self.table:
            if required or default is ...:
                raise self.fail(key, "is required")
            return default
        value = self.table[key]
        # bool is an int in Python; do not let `true` pass for a number.
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise self.fail(key, f"must be {_kind_name(kind)}, got {value!r}")
        if not isinstance(value, kind):
            raise self.fail(key, f"must be {_kind_name(kind)}, got {value!r}")
        return value

    def check_unknown(self, allowed: set[str]) -> None:
        unknown = sorted(set(self.table) - allowed)
        if unknown:
            raise self.fail(unknown[0], f"unknown field (known: {', '.join(sorted(allowed))})")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if set(kinds) == {int, float}:
        return "a number"
    names = {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "true or false",
        dict: "a table",
        list: "a list",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def validate_speculative(spec: Mapping[str, Any], where: str, path: str) -> None:
    """The checks every consumer needs; `specproxy engines` adds launch-time checks on top."""
    r = _Reader(where, spec, path)
    if not spec:
        return
    method = r.get("method", str, required=True)
    if method in REMOVED_SPEC_METHODS:
        raise r.fail("method", f"{method!r} was removed in vLLM 0.33; use eagle3, mtp, draft_model or ngram")
    if method not in SPEC_METHODS:
        raise r.fail("method", f"unknown method {method!r} (one of: {', '.join(sorted(SPEC_METHODS))})")
    k = r.get("num_speculative_tokens", int, None)
    if k is not None and k < 1:
        raise r.fail("num_speculative_tokens", "must be ≥ 1")
    if method == "ngram":
        lo = r.get("prompt_lookup_min", int, None)
        hi = r.get("prompt_lookup_max", int, None)
        for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and v < 1:
                raise r.fail(key, "must be ≥ 1")
        if lo is not None and hi is not None and lo > hi:
            raise r.fail("prompt_lookup_min", f"must be ≤ prompt_lookup_max ({lo} > {hi})")
    if method in ("draft_model", "eagle", "eagle3"):
        r.get("model", str, required=True)


def _frozen_map(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(
        {
            k: _frozen_map(v) if isinstance(v, Mapping) else tuple(v) if isinstance(v, list) else v
            for k, v in d.items()
        }
    )


def _load_engine(where: str, table: Mapping[str, Any], path: str) -> EngineSettings:
    r = _Reader(where, table, path)
    r.used.add("kind")  # read by _engine_kind
    port = r.get("port", int, None)
    gpus = r.get("gpus", list, [])
    if not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
        raise r.fail("gpus", "must be a list of GPU indices (integers ≥ 0)")
    tp = r.get("tensor_parallel_size", int, 1)
    if tp < 1:
        raise r.fail("tensor_parallel_size", "must be ≥ 1")
    mns = r.get("max_num_seqs", int, None)
    if mns is not None and mns < 1:
        raise r.fail("max_num_seqs", "must be ≥ 1")
    gmu = r.get("gpu_memory_utilization", (int, float), None)
    if gmu is not None and not 0 < gmu <= 1:
        raise r.fail("gpu_memory_utilization", "must be in (0, 1]")
    mml = r.get("max_model_len", int, None)
    extra = r.get("extra_args", list, [])
    if not all(isinstance(a, str) for a in extra):
        raise r.fail("extra_args", "must be a list of strings")
    env = r.get("env", dict, {})
    if not all(isinstance(v, str) for v in env.values()):
        raise r.fail("env", "values must be strings")
    r.check_unknown(r.used)
    return EngineSettings(
        port=port,
        gpus=tuple(gpus),
        tensor_parallel_size=tp,
        max_num_seqs=mns,
        gpu_memory_utilization=float(gmu) if gmu is not None else None,
        max_model_len=mml,
        extra_args=tuple(extra),
        env=MappingProxyType(dict(env)),
    )


def _load_arm(where: str, table: Any, index: int) -> Arm:
    path = f"arms[{index}]"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: {path}: must be a table")
    r = _Reader(where, table, path)
    name = r.get("name", str, required=True)
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise r.fail("name", f"must be letters, digits, '-', '_' or '.', got {name!r}")
    url = r.get("url", str, required=True).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise r.fail("url", f"must start with http:// or https://, got {url!r}")
    role = r.get("role", str, "candidate")
    if role not in ROLES:
        raise r.fail("role", f"must be 'baseline', 'candidate' or 'replica', got {role!r}")
    weight = float(r.get("weight", (int, float), 1.0))
    if weight < 0:
        raise r.fail("weight", "must be ≥ 0")
    spec = r.get("speculative", dict, {})
    validate_speculative(spec, where, f"{path}.speculative")
    if role == "replica" and spec:
        raise r.fail(
            "speculative",
            "a replica is a plain copy of the baseline and runs without speculation; "
            'remove speculative, or make this arm role = "candidate"',
        )
    sample = float(r.get("sample", (int, float), 1.0))
    if not 0 <= sample <= 1:
        raise r.fail("sample", "must be between 0 and 1")
    msi = r.get("max_shadow_inflight", int, 64)
    if msi < 1:
        raise r.fail("max_shadow_inflight", "must be ≥ 1")
    behind = r.get("replicas_behind_url", int, 1)
    if behind < 1:
        raise r.fail("replicas_behind_url", "must be ≥ 1 (the engines behind the arm's URL)")
    key_env = r.get("api_key_env", str, None)
    ext = r.get("vllm_extensions", str, "auto")
    if ext not in ("auto", "on", "off"):
        raise r.fail("vllm_extensions", f"must be 'auto', 'on' or 'off', got {ext!r}")
    rti = r.get("return_token_ids", bool, False)
    desc = r.get("description", str, "")
    engine_value = r.get("engine", (str, dict), {})
    engine_kind = _engine_kind(r, engine_value)
    engine = _load_engine(where, engine_value if isinstance(engine_value, dict) else {}, f"{path}.engine")
    tokenizer = _tokenizer_path(r, where)
    r.check_unknown(r.used)
    return Arm(
        name=name,
        url=url,
        role=role,
        weight=weight,
        speculative=_frozen_map(spec),
        sample=sample,
        max_shadow_inflight=msi,
        replicas_behind_url=behind,
        api_key_env=key_env,
        vllm_extensions=ext,
        return_token_ids=rti,
        description=desc,
        engine=engine,
        engine_kind=engine_kind,
        tokenizer=tokenizer,
    )


def _engine_kind(r: _Reader, value: str | Mapping[str, Any]) -> str:
    kind = value if isinstance(value, str) else value.get("kind", "auto")
    if kind not in ENGINE_KINDS:
        key = "engine" if isinstance(value, str) else "engine.kind"
        raise r.fail(key, f"must be one of {', '.join(repr(k) for k in ENGINE_KINDS)}, got {kind!r}")
    return str(kind)


def _tokenizer_path(r: _Reader, where: str) -> str | None:
    """The tokenizer.json (or .gguf model) named in this table, relative to the experiment file; it
    must exist, and reading it needs its extra installed: tokenizers for a tokenizer.json,
    llama-cpp-python for a GGUF."""
    value = r.get("tokenizer", str, None)
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_absolute() and not where.startswith("<"):
        path = Path(where).resolve().parent / path
    if not path.is_file():
        raise r.fail("tokenizer", f"{value!r} is not a file (a tokenizer.json or a .gguf, read offline)")
    if path.suffix.lower() == ".gguf" and importlib.util.find_spec("llama_cpp") is None:
        raise r.fail(
            "tokenizer",
            f"{value!r} is a GGUF model: reading its tokenizer needs llama-cpp-python "
            "(pip install 'specproxy[llamacpp]')",
        )
    if path.suffix.lower() != ".gguf" and importlib.util.find_spec("tokenizers") is None:
        raise r.fail(
            "tokenizer",
            f"{value!r} is a tokenizer.json: reading it needs the tokenizers package, which the light "
            "install leaves out (pip install 'specproxy[tokenizers]')",
        )
    return str(path)


def parse_experiment(data: Mapping[str, Any], where: str = "<experiment>") -> Experiment:
    """Validate an already-parsed TOML document (``where`` names it in errors)."""
    top = _Reader(where, data, "")
    exp_table = top.get("experiment", dict, {})
    arms_list = top.get("arms", list, required=True)
    slo = _load_slo(where, top.get("slo", dict, None))
    top.check_unknown({"experiment", "arms", "slo"})
    r = _Reader(where, exp_table, "experiment")
    name = r.get("name", str, "experiment")
    mode = r.get("mode", str, "shadow")
    if mode not in ("shadow", "split"):
        raise r.fail("mode", f"must be 'shadow' or 'split', got {mode!r}")
    arms = tuple(_load_arm(where, t, i) for i, t in enumerate(arms_list))
    _check_arms(where, arms, mode)
    sticky = r.get("sticky_key", str, "")
    if sticky not in ("", "user") and not (sticky.startswith("header:") and len(sticky) > 7):
        raise r.fail("sticky_key", f"must be '', 'user' or 'header:NAME', got {sticky!r}")
    vf = float(r.get("verify_fraction", (int, float), 0.0))
    if not 0 <= vf <= 1:
        raise r.fail("verify_fraction", "must be between 0 and 1")

    tokenizer = _tokenizer_path(r, where)
    if tokenizer is not None:  # the arms without their own tokenizer use the experiment's
        arms = tuple(a if a.tokenizer else dataclasses.replace(a, tokenizer=tokenizer) for a in arms)
    at_concurrency, peak_concurrency, at_rate, peak_rate = _operating_points(r)

    exp = Experiment(
        name=name,
        arms=arms,
        mode=mode,
        db=r.get("db", str, "specproxy.duckdb"),
        model=r.get("model", str, None),
        description=r.get("description", str, ""),
        sticky_key=sticky,
        verify_fraction=vf,
        upstream_connect_timeout_s=float(_positive(r, "upstream_connect_timeout_s", 10.0)),
        upstream_read_timeout_s=_positive(r, "upstream_read_timeout_s", 600.0),
        shadow_timeout_s=float(_positive(r, "shadow_timeout_s", 600.0)),
        max_body_bytes=int(_positive(r, "max_body_bytes", 32 * 1024 * 1024)),
        client_header_timeout_s=float(_positive(r, "client_header_timeout_s", 30.0)),
        client_body_timeout_s=float(_positive(r, "client_body_timeout_s", 60.0)),
        max_client_connections=_optional_int(_positive(r, "max_client_connections", None)),
        shutdown_grace_s=float(_positive(r, "shutdown_grace_s", 30.0)),
        span_queue_size=int(_positive(r, "span_queue_size", 100_000)),
        scrape_interval_s=float(_positive(r, "scrape_interval_s", 5.0)),
        otlp_endpoint=r.get("otlp_endpoint", str, None),
        source_path=None if where.startswith("<") else where,
        tokenizer=tokenizer,
        at_concurrency=at_concurrency,
        peak_concurrency=peak_concurrency,
        at_rate=float(at_rate) if at_rate is not None else None,
        peak_rate=float(peak_rate) if peak_rate is not None else None,
        slo=slo,
        gpu_hour_usd=_optional_float(_positive(r, "gpu_hour_usd", None)),
    )
    r.check_unknown(r.used)
    return exp


def _check_arms(where: str, arms: tuple[Arm, ...], mode: str) -> None:
    """ConfigError unless there is an arm, exactly one baseline, no name twice, and (split) a weight."""
    if not arms:
        raise ConfigError(f"{where}: arms: at least one arm is required")
    baselines = [i for i, a in enumerate(arms) if a.role == "baseline"]
    if len(baselines) != 1:
        raise ConfigError(
            f'{where}: arms: exactly one arm must have role = "baseline" (found {len(baselines)})'
        )
    seen: set[str] = set()
    for i, a in enumerate(arms):
        if a.name in seen:
            raise ConfigError(f"{where}: arms[{i}].name: duplicate arm name {a.name!r}")
        seen.add(a.name)
    if mode == "split" and sum(a.weight for a in arms) <= 0:
        raise ConfigError(f"{where}: arms: split mode needs at least one arm with weight > 0")


def _positive(r: _Reader, key: str, default: float | None) -> Any:
    v = r.get(key, (int, float), default)
    if v is not None and v <= 0:
        raise r.fail(key, "must be > 0")
    return v


def _concurrency(r: _Reader, key: str) -> int | None:
    v = r.get(key, int, None)
    if v is not None and v < 1:
        raise r.fail(key, f"must be a concurrency ≥ 1, got {v}")
    return int(v) if v is not None else None


def _operating_points(r: _Reader) -> tuple[int | None, int | None, Any, Any]:
    """The experiment's at/peak concurrency and at/peak rate, each peak at least its 'at'."""
    at_concurrency = _concurrency(r, "at_concurrency")
    peak_concurrency = _concurrency(r, "peak_concurrency")
    if at_concurrency is not None and peak_concurrency is not None and peak_concurrency < at_concurrency:
        raise r.fail(
            "peak_concurrency",
            "must be ≥ at_concurrency (the peak is the busiest you run): "
            f"{peak_concurrency} < {at_concurrency}",
        )
    at_rate, peak_rate = _positive(r, "at_rate", None), _positive(r, "peak_rate", None)
    if at_rate is not None and peak_rate is not None and peak_rate < at_rate:
        raise r.fail(
            "peak_rate", f"must be ≥ at_rate (the peak is the busiest you run): {peak_rate} < {at_rate}"
        )
    return at_concurrency, peak_concurrency, at_rate, peak_rate


def _load_slo(where: str, table: Mapping[str, Any] | None) -> Slo | None:
    if table is None:
        return None
    try:
        return slo_from_table(table)
    except SloError as exc:
        raise ConfigError(f"{where}: slo: {exc}") from None


def _optional_float(value: float | None) -> float | None:
    return float(value) if value is not None else None


def _optional_int(value: float | None) -> int | None:
    return int(value) if value is not None else None


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment file; every problem is a :class:`ConfigError`."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the experiment file ({exc.strerror or exc})") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from exc
    return parse_experiment(data, str(p))


def experiment_json(exp: Experiment) -> str:
    """The experiment as JSON for ``runs.config_json`` (holds env var names, never keys)."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        return value

    return json.dumps(plain(exp), sort_keys=True)

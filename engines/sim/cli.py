"""`specproxy sim`: parse flags, build a `SimConfig`, serve `create_sim_app` until interrupted."""

from __future__ import annotations

import asyncio
import gc
import sys

import click

from specproxy.commandline import listen_options, run_async
from specproxy.engines.profiles import ProfileError, load_profile
from specproxy.engines.sim.config import Faults, SimConfig, SimConfigError, SpeculativeConfig


def speculative_from_flags(
    method: str | None, num_speculative_tokens: int | None, speculative_config: str | None
) -> SpeculativeConfig | None:
    """The speculative config the flags ask for; `--method/--num-speculative-tokens` stand for the JSON."""
    if speculative_config:
        spec = SpeculativeConfig.from_json(speculative_config)
        if method and method != spec.method:
            raise SimConfigError(f"--method {method} contradicts --speculative-config method '{spec.method}'")
        if num_speculative_tokens is not None and num_speculative_tokens != spec.num_speculative_tokens:
            raise SimConfigError("--num-speculative-tokens contradicts --speculative-config")
        return spec
    if method and method != "none":
        raw: dict[str, object] = {"method": method}
        # n-gram, draft model and EAGLE-3 as `specproxy lab` runs them (a test keeps them in step).
        defaults = {"ngram": 5, "suffix": 16, "mtp": 1, "eagle": 3, "eagle3": 3, "draft_model": 4}
        raw["num_speculative_tokens"] = num_speculative_tokens or defaults.get(method, 3)
        if method == "ngram":
            raw.update(prompt_lookup_min=1, prompt_lookup_max=4)
        if method == "draft_model":
            raw["model"] = "meta-llama/Llama-3.2-1B-Instruct"
        if method in ("eagle", "eagle3"):
            raw["model"] = (
                "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
                if method == "eagle3"
                else "yuhuili/EAGLE-LLaMA3.1-Instruct-8B"
            )
        return SpeculativeConfig.from_dict(raw)
    if num_speculative_tokens is not None:
        raise SimConfigError("--num-speculative-tokens needs --method (or --speculative-config)")
    return None


@click.command("sim", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--method",
    type=click.Choice(["none", "ngram", "draft_model", "eagle", "eagle3", "mtp", "suffix"]),
    default=None,
    help="Speculative method (shorthand for --speculative-config with defaults).",
)
@click.option(
    "--num-speculative-tokens", type=int, default=None, help="Draft tokens per step k (with --method)."
)
@click.option(
    "--speculative-config",
    "-sc",
    default=None,
    help="vLLM's --speculative-config JSON, verbatim, e.g. "
    '\'{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":5}\'.',
)
@listen_options(port_note=" (0: a free one)")
@click.option(
    "--model",
    default="meta-llama/Llama-3.1-8B-Instruct",
    show_default=True,
    help="Model the simulated server pretends to run; outputs are keyed by it.",
)
@click.option("--served-model-name", default=None, help="Name clients use in 'model' (default: --model).")
@click.option(
    "--profile",
    default="h100-llama3.1-8b",
    show_default=True,
    help="Cost profile: a name in engines/profiles or a path to a profile JSON file.",
)
@click.option(
    "--time-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Run the engine clock this many times faster than the profile's step times.",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed for acceptance draws and faults (outputs depend only on model and prompt).",
)
@click.option(
    "--per-request-spec-decode-metrics",
    type=click.Choice(["none", "summary", "detailed"]),
    default="none",
    show_default=True,
    help="Like vLLM: add metrics.speculative_decoding to responses (final usage chunk when streaming).",
)
@click.option(
    "--max-num-seqs", type=int, default=None, help="Max requests per step (default: the profile's)."
)
@click.option(
    "--max-num-batched-tokens", type=int, default=None, help="Token budget per step (default: the profile's)."
)
@click.option(
    "--lossy-rate",
    type=float,
    default=0.0,
    show_default=True,
    help="Share of greedy outputs that diverge from the lossless text at a near-tie position.",
)
@click.option(
    "--error-rate",
    type=float,
    default=0.0,
    show_default=True,
    help="Share of requests answered with HTTP 500.",
)
@click.option(
    "--stall-ms",
    type=float,
    default=0.0,
    show_default=True,
    help="Pause every response this long mid-stream (after its first chunk).",
)
@click.option(
    "--drop-rate",
    type=float,
    default=0.0,
    show_default=True,
    help="Share of requests whose connection is cut mid-stream.",
)
@click.option(
    "--kv-cache-tokens",
    type=int,
    default=None,
    help="KV-cache capacity in tokens (default: the profile's); past it requests wait or are preempted.",
)
@click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=True,
    show_default=True,
    help="Like vLLM: reuse the KV of prompt prefixes (16-token blocks) seen before.",
)
@click.option(
    "--max-concurrency",
    type=int,
    default=None,
    help="Admit at most this many requests at once; the rest queue.",
)
def sim(
    method: str | None,
    num_speculative_tokens: int | None,
    speculative_config: str | None,
    host: str,
    port: int,
    model: str,
    served_model_name: str | None,
    profile: str,
    time_scale: float,
    seed: int,
    per_request_spec_decode_metrics: str,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    lossy_rate: float,
    error_rate: float,
    stall_ms: float,
    drop_rate: float,
    kv_cache_tokens: int | None,
    enable_prefix_caching: bool,
    max_concurrency: int | None,
) -> None:
    """A vLLM-shaped simulated backend with speculative decoding.

    Speaks vLLM 0.33's OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /version, /metrics) and adds ground truth at /sim/requests/{id} and /sim/stats.

    Example: specproxy sim --method eagle3 --num-speculative-tokens 3 --port 8002 --time-scale 10
    """
    try:
        faults = Faults(
            lossy_rate=lossy_rate,
            error_rate=error_rate,
            stall_ms=stall_ms,
            drop_rate=drop_rate,
            max_concurrency=max_concurrency,
        )
        config = SimConfig(
            model=model,
            served_model_name=served_model_name,
            speculative=speculative_from_flags(method, num_speculative_tokens, speculative_config),
            profile=profile,
            time_scale=time_scale,
            seed=seed,
            per_request_spec_decode_metrics=per_request_spec_decode_metrics,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            faults=faults,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_tokens=kv_cache_tokens,
        )
        cost = load_profile(config.profile)
    except (SimConfigError, ProfileError) as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        run_async(_serve(config, cost.name, host, port))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


async def _serve(config: SimConfig, profile_name: str, host: str, port: int) -> None:
    import signal

    from specproxy.engines.sim.server import running_sim

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with running_sim(config, host=host, port=port) as sim:
            spec = config.speculative
            described = f"{spec.method} k={spec.num_speculative_tokens}" if spec else "no speculation"
            click.echo(
                f"specproxy sim: model {config.served_name}, {described}, profile {profile_name}, "
                f"time scale {config.time_scale:g} (engine clock {config.time_scale:g}x the profile's speed)"
            )
            click.echo(f"specproxy sim listening on {sim.url}")
            sys.stdout.flush()
            # What startup built (profiles, tokenizer tables, the app) lives for the whole run: keep it
            # out of the collector's full passes, which otherwise stall every stream for tens of ms.
            gc.collect()
            gc.freeze()
            await stop.wait()
    except SimConfigError as exc:
        raise click.ClickException(str(exc)) from exc

"""Measure a GPU's step-time profile for the simulator: `python -m specproxy.engines.calibrate --out DIR`.

Times the forward passes that a vLLM engine step is made of, on random bf16 weights of the real
shapes, and fits the simulator's cost profile (engines/calibrate_fit.py) to them:

- the target, a Llama-3.1-8B-shaped decoder (32 layers, hidden 4096, 32 query / 8 KV heads, MLP
  14336, vocab 128256), over a KV cache, for batch B x query tokens per request q (1 = decode,
  k+1 = verification) x context per request; logits for every query token, as verification needs;
- a Llama-3.2-1B-shaped draft model (16 layers, hidden 2048, 32/8 heads of 64, MLP 8192), one
  forward over the batch (one token per request);
- EAGLE3- and EAGLE-1-shaped heads drafting k tokens for the batch: fc over the concatenated target
  hidden states (3x4096 or 2x4096 -> 4096), one decoder layer whose attention takes [embedding;
  hidden] (EAGLE3: qkv in 8192) and an LM head (EAGLE3: 32000-token draft vocabulary), first over the
  B*(k+1) tokens the last verification produced, then k-1 chained steps over B tokens;
- prefill chunks of one fresh prompt (causal attention, logits for the last token only);
- a device-to-device copy, whose bandwidth sets the weight-read floor of a decode step.

Every timed thing is captured once as a CUDA graph and replayed (a decode step is several hundred
small kernels: eager launch overhead, not the GPU, would otherwise dominate, as an earlier
eager probe showed), timed with CUDA events around each replay; the median of the replays is kept.

Kernels, chosen to be close to what vLLM runs: each layer's work outside attention (RMSNorm, QKV,
rotary, residuals, SwiGLU) goes through torch.compile (Inductor fuses the elementwise work, as
vLLM's compiled model does; GEMMs stay cuBLAS), checked against the eager functions at start and
dropped for the whole run if compiling fails. Attention is torch's fused SDPA with the 4 query
heads of each KV head folded into the query length (the GQA trick of flash-decoding: the KV cache
is read once per KV head, never expanded), with no mask: the q new tokens attend to all ctx+q
keys, the same cost as the causal mask among them to within q^2 of ctx*q. Its backend is chosen
per batch class (flash splits a long KV across the GPU at small batch; cuDNN is faster at large
batch) by graph-timed probes at start. Differences from a vLLM step that the profile inherits:
no paged KV (one contiguous cache per request, all requests the same length), no sampler, no
scheduler (that is `step_overhead_s`, kept from the H100 fit).

torch is imported lazily: this module is importable (and its CPU path testable with `--tiny
--device cpu`) without a GPU; specproxy does not depend on torch.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from specproxy.engines.calibrate.fit import POINT_COLUMNS, Point, build_profile, profile_problems, read_points
from specproxy.engines.calibrate.shapes import (
    LLAMA_3_1_8B,
    LLAMA_3_2_1B,
    TINY_DRAFT,
    TINY_GRID,
    TINY_TARGET,
    Grid,
)
from specproxy.engines.calibrate.steps import ModelSteps, layer_functions


class Calibrator(ModelSteps):
    """Times the model steps (:class:`~specproxy.engines.calibrate.steps.ModelSteps`) on the device:
    CUDA graphs, CUDA events, the SDPA backend probe and the torch.compile check; each point one
    :class:`Point`. Everything torch-specific lives behind a lazy import.
    """

    # timing --------------------------------------------------------------------------------
    def _synchronize(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def _graphed(self, step: Callable[[], Any]) -> Callable[[], Any]:
        """Capture `step` as a CUDA graph (after one warm-up run on a side stream, as torch
        requires) and return its replay; on CPU, `step` itself."""
        if not self.cuda:
            return step
        torch = self.torch
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay: Callable[[], Any] = graph.replay
        return replay

    def _time_once(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            torch = self.torch
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def measure(
        self, fn: Callable[[], Any], target_s: float = 0.3, graph: bool = True
    ) -> tuple[float, float, float, int]:
        """Median, 20th and 80th percentile of repeated timed runs (after warm-up); the count
        adapts so each configuration takes about `target_s`, between 5 and 30 runs."""
        replay = self._graphed(fn) if graph else fn
        for _ in range(2):
            replay()
        first = self._time_once(replay)
        reps = int(min(30, max(5, target_s / max(first, 1e-6))))
        times = sorted(self._time_once(replay) for _ in range(reps))
        return _quantile(times, 0.5), _quantile(times, 0.2), _quantile(times, 0.8), reps

    @contextmanager
    def plain(self, default_sdpa: bool = False) -> Iterator[None]:
        """Within: no torch.compile (and torch's own SDPA dispatch if asked)."""
        saved = (self.fused, self.sdpa_small, self.sdpa_large)
        self.fused = False
        if default_sdpa:
            self.sdpa_small, self.sdpa_large = [], []
        try:
            yield
        finally:
            self.fused, self.sdpa_small, self.sdpa_large = saved

    def choose_sdpa_backend(self, log: Callable[[str], None]) -> dict[str, Any]:
        """For small and for large batches, time each fused SDPA backend on decode/verify shapes
        (folded GQA; one CUDA graph of 8 calls per shape, so launch overhead stays out) and keep
        the fastest that runs them all. (A first run picked one backend for all batches from
        eager timings, which launch overhead dominated: cuDNN's kernel then cost several ms a
        step at batch 1 over 8k tokens, flash's about 30% more than cuDNN's at batch 256.)"""
        report: dict[str, Any] = {}
        if not self.cuda:
            return report
        from torch.nn.attention import SDPBackend, sdpa_kernel

        f = self.torch.nn.functional
        s = self.target_shape
        g = s.q_heads // s.kv_heads
        classes = {  # (batch, KV length, query tokens per request)
            "small": [(1, 8192, 1), (1, 2048, 4), (4, 2048, 8), (8, 1024, 2)],
            "large": [(32, 8192, 1), (64, 2048, 4), (256, 1024, 1), (256, 2048, 8)],
        }
        for cls, shapes in classes.items():
            times: dict[str, float] = {}
            for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
                backend = getattr(SDPBackend, name, None)
                if backend is None:
                    continue
                total = 0.0
                try:
                    for b, length, n in shapes:
                        q = self._rand(b, s.kv_heads, g * n, s.head_dim, std=1.0)
                        kv = self._rand(b, 2 * s.kv_heads, length, s.head_dim, std=1.0)

                        def run(q: Any = q, kv: Any = kv, backend: Any = backend) -> Any:
                            keys, values = kv[:, : s.kv_heads], kv[:, s.kv_heads :]
                            with sdpa_kernel([backend]):
                                for _ in range(8):
                                    out = f.scaled_dot_product_attention(q, keys, values)
                            return out

                        total += self.measure(run, target_s=0.05)[0] / 8
                except Exception as exc:  # a backend that does not support a shape: not a candidate
                    log(f"sdpa {cls} {name}: unavailable ({type(exc).__name__}: {str(exc)[:120]})")
                    continue
                times[name] = total
            log(f"sdpa, {cls} batches: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in times.items()))
            if times:
                best = min(times, key=lambda k: times[k])
                setattr(self, f"sdpa_{cls}", [getattr(SDPBackend, best)])
                report[cls] = {
                    "chosen": best,
                    "us_summed_over_probe_shapes": {k: round(v * 1e6, 1) for k, v in times.items()},
                }
        self.torch.cuda.empty_cache()
        return report

    def check_compiled(self, log: Callable[[str], None]) -> dict[str, Any]:
        """Compile the target's layer functions and check them against the uncompiled ones on the
        same fresh inputs; on any failure (or a compile slower than `max_first_compile_s`), fall
        back to unfused layers for the whole run."""
        report: dict[str, Any] = {"requested": self.fused}
        if not self.fused:
            return report
        import torch._dynamo as dynamo
        import torch.fx.experimental._config as fx_config

        # Many (batch, tokens) shapes go through one compiled function: let it recompile (sizes
        # of 1 get their own graphs), and do not tie sizes that happen to be equal (batch 2 with
        # 2 tokens) to each other, which would recompile at the next shape. (Treating sizes of 1
        # as general, `backed_size_oblivious`, gave wrong results in a CPU check: not used.)
        for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, 512)
        if hasattr(fx_config, "use_duck_shape"):
            fx_config.use_duck_shape = False
        started = time.monotonic()
        s = self.target_shape
        try:
            b, n = 3, 2
            w = self.target["layers"][0]
            layer_in = self._rand(b * n, s.hidden, std=1.0)
            cos, sin = self._rope_tables(s, 100, n)
            pre, post = layer_functions(s)
            cpre, cpost = self._layer_fns(s)
            errs = []
            for got, ref in zip(
                cpre(layer_in, w["ln1"], w["wqkv"], cos, sin),
                pre(layer_in, w["ln1"], w["wqkv"], cos, sin),
                strict=True,
            ):
                errs.append(float((got.float() - ref.float()).norm() / ref.float().norm()))
            o = self._rand(b, s.kv_heads, s.q_heads // s.kv_heads * n, s.head_dim, std=1.0)
            args = (layer_in, o, w["wo"], w["ln2"], w["wgu"], w["wdown"])
            got, ref = cpost(*args), post(*args)
            errs.append(float((got.float() - ref.float()).norm() / ref.float().norm()))
            self._synchronize()
            report["rel_err"] = max(errs)
            if not max(errs) < 3e-2:
                raise ValueError(
                    f"compiled layer differs from the eager one (relative error {max(errs):.2e})"
                )
            elapsed = time.monotonic() - started
            log(f"torch.compile: first compile {elapsed:.1f} s, relative error vs eager {max(errs):.1e}")
            if elapsed > self.max_first_compile_s:
                raise TimeoutError(
                    f"first compile took {elapsed:.0f} s, over {self.max_first_compile_s:.0f} s"
                )
        except Exception as exc:
            log(f"torch.compile off: {type(exc).__name__}: {str(exc)[:300]}")
            self.fused = False
            report["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        report["enabled"] = self.fused
        report["first_compile_s"] = round(time.monotonic() - started, 1)
        return report

    def copy_point(self) -> Point:
        """Device-to-device copy of `copy_bytes`, timed; bytes counted read plus written.

        Timed eagerly: one copy takes milliseconds, and a copy captured in a CUDA graph runs on
        the copy engines, slower than the copy kernel an eager cudaMemcpy uses."""
        n = self.grid.copy_bytes // 2
        src = self.torch.empty(n, device=self.device, dtype=self.torch.bfloat16).normal_()
        dst = self.torch.empty_like(src)
        med, p20, p80, reps = self.measure(lambda: dst.copy_(src), graph=False)
        return Point("copy", 0, 0, 0, 0, 0, med, p20, p80, reps, bytes=2 * n * 2)


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def plan(cal: Calibrator) -> Iterator[tuple[str, Callable[[], Point]]]:
    """Everything to time, most important first (a run cut short by its budget keeps the core).

    Besides the profile's kinds, a few diagnostic rows for the sanity check (ignored by the fit):
    `target_gemm_only` (the weight GEMMs alone) and `target_unfused` (no torch.compile: what
    eager kernels under CUDA graphs give)."""
    grid = cal.grid

    def target(b: int, q: int, c: int, kind: str = "target") -> Callable[[], Point]:
        def run() -> Point:
            med, p20, p80, reps = cal.measure(cal.decoder_step("target", b, q, c))
            return Point(kind, b, q, c, b * q, b * (c + q), med, p20, p80, reps)

        if kind == "target_unfused":

            def plain_run() -> Point:
                with cal.plain():
                    return run()

            return plain_run
        return run

    def gemm_only(b: int) -> Callable[[], Point]:
        def run() -> Point:
            med, p20, p80, reps = cal.measure(cal.gemm_only_step(b))
            return Point("target_gemm_only", b, 1, 0, b, 0, med, p20, p80, reps)

        return run

    def draft(b: int, c: int) -> Callable[[], Point]:
        def run() -> Point:
            med, p20, p80, reps = cal.measure(cal.decoder_step("draft", b, 1, c))
            return Point("draft_model", b, 1, c, b, b * (c + 1), med, p20, p80, reps)

        return run

    def eagle(name: str, b: int, k: int, c: int) -> Callable[[], Point]:
        def run() -> Point:
            med, p20, p80, reps = cal.measure(cal.eagle_step(name, b, k, c))
            return Point(name, b, k, c, b * (k + 1), b * c, med, p20, p80, reps)

        return run

    def prefill(chunk: int) -> Callable[[], Point]:
        def run() -> Point:
            med, p20, p80, reps = cal.measure(cal.prefill_step(chunk))
            return Point("prefill", 1, chunk, 0, chunk, chunk, med, p20, p80, reps)

        return run

    yield "copy", cal.copy_point
    configs = grid.target_configs()
    for b in (1, grid.batches[len(grid.batches) // 2]):
        yield f"target_gemm_only B={b}", gemm_only(b)
    diag_ctx = sorted({grid.contexts[0], grid.contexts[-1]})
    for b, q, c in [(1, 1, diag_ctx[0]), (1, 1, diag_ctx[-1]), (grid.batches[-1], 1, diag_ctx[0])]:
        yield f"target_unfused B={b} q={q} ctx={c}", target(b, q, c, "target_unfused")
    for b, q, c in configs:
        yield f"target B={b} q={q} ctx={c}", target(b, q, c)
    for chunk in grid.prefill_chunks:
        yield f"prefill chunk={chunk}", prefill(chunk)
    draft_configs = sorted({(b, c) for b, _, c in configs})
    for b, c in draft_configs:
        yield f"draft_model B={b} ctx={c}", draft(b, c)
    for name in ("eagle3", "eagle"):
        for b, c in draft_configs:
            for k in grid.draft_ks:
                yield f"{name} B={b} k={k} ctx={c}", eagle(name, b, k, c)


def describe_stack(cal: Calibrator) -> dict[str, Any]:
    """Where the numbers came from: torch, CUDA, GPU, driver, SDPA backend, weight bytes."""
    torch = cal.torch
    stack: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cal.cuda else None,
        "device": str(cal.device),
        "dtype": str(cal.dtype).removeprefix("torch."),
        "sdpa_backend": {
            "small_batches": _backend_name(cal.sdpa_small),
            "large_batches": _backend_name(cal.sdpa_large),
        },
        "cuda_graphs": cal.cuda,
        "torch_compile": cal.fused,
        "weight_bytes_read_per_step": cal.weight_bytes_read_per_step(),
        "target_shape": asdict(cal.target_shape),
        "draft_shape": asdict(cal.draft_shape),
        "eagle_shapes": [asdict(e) for e, _ in cal.eagles.values()],
        "max_kv_tokens": cal.grid.max_kv_tokens,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if cal.cuda:
        props = torch.cuda.get_device_properties(cal.device)
        stack["gpu"] = props.name
        stack["gpu_memory_bytes"] = props.total_memory
        stack["sm_count"] = props.multi_processor_count
        stack["compute_capability"] = f"{props.major}.{props.minor}"
        stack["driver"] = _nvidia_smi("driver_version")
        stack["clocks_at_start"] = _nvidia_smi("clocks.sm,clocks.mem,clocks.max.sm,power.limit")
    else:
        stack["gpu"] = f"CPU ({platform.processor() or platform.machine()})"
    try:
        import flash_attn  # noqa: F401

        stack["flash_attn_package"] = getattr(sys.modules["flash_attn"], "__version__", "present")
    except ImportError:
        stack["flash_attn_package"] = None
    return stack


def _backend_name(backends: list[Any]) -> str:
    return str(backends[0]).rsplit(".", 1)[-1] if backends else "torch default"


def _nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def run_calibration(
    out: Path,
    name: str,
    device: str,
    tiny: bool,
    budget_s: float,
    log: Callable[[str], None],
    fused: bool,
    started: float,
) -> dict[str, Any]:
    """Measure, append each point to NAME.points.csv as it is taken, then fit NAME.json (``started``:
    the monotonic clock when the work began, for the log's timings)."""
    grid = TINY_GRID if tiny else Grid()
    target, draft = (TINY_TARGET, TINY_DRAFT) if tiny else (LLAMA_3_1_8B, LLAMA_3_2_1B)
    cal = Calibrator(device, target, draft, grid, tiny, fused=fused)
    log(f"weights and caches ready in {time.monotonic() - started:.1f} s")
    sdpa_report = cal.choose_sdpa_backend(log)
    compile_report = cal.check_compiled(log)
    stack = describe_stack(cal)
    stack["sdpa_probe"] = sdpa_report
    stack["torch_compile_check"] = compile_report
    out.mkdir(parents=True, exist_ok=True)
    stack_path = out / f"{name}.stack.json"
    stack_path.write_text(json.dumps(stack, indent=2) + "\n")
    points_path = out / f"{name}.points.csv"
    skipped: list[str] = []
    fallbacks: list[str] = []
    with open(points_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=POINT_COLUMNS)
        writer.writeheader()
        for label, take in plan(cal):
            if time.monotonic() - started > budget_s:
                skipped.append(label)
                continue
            try:
                point = take()
            except Exception as exc:  # one failing shape (e.g. out of memory) must not lose the rest
                log(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                if cal.cuda:
                    cal.torch.cuda.synchronize()
                    cal.torch.cuda.empty_cache()
                # Retry once the plainest way: eager kernels, torch's own SDPA dispatch.
                try:
                    with cal.plain(default_sdpa=True):
                        point = take()
                    log(f"{label}: retried without torch.compile and with torch's SDPA dispatch")
                    fallbacks.append(label)
                except Exception as exc2:
                    log(f"{label}: FAILED again {type(exc2).__name__}: {str(exc2)[:300]}")
                    skipped.append(label)
                    continue
            writer.writerow(asdict(point))
            fh.flush()
            log(
                f"{label}: {point.median_s * 1e3:.3f} ms (p20 {point.p20_s * 1e3:.3f}, "
                f"p80 {point.p80_s * 1e3:.3f}, {point.reps} reps)"
            )
    if skipped:
        log(f"skipped {len(skipped)} configurations (budget or failure): {', '.join(skipped[:20])}")
    stack["skipped"] = skipped
    stack["plain_fallback_for"] = fallbacks
    if cal.fused:
        from torch._dynamo.utils import counters

        stack["torch_compile_check"]["graphs_compiled"] = int(counters["stats"]["unique_graphs"])
    stack["elapsed_s"] = round(time.monotonic() - started, 1)
    stack_path.write_text(json.dumps(stack, indent=2) + "\n")
    profile = build_profile(read_points(points_path), stack, name=name, date=stack["date"][:10])
    problems = profile_problems(profile)
    if problems:
        raise click.ClickException("the fitted profile does not validate: " + "; ".join(problems))
    (out / f"{name}.json").write_text(json.dumps(profile, indent=2) + "\n")
    return profile


@click.command()
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Folder to write NAME.json, NAME.points.csv and NAME.stack.json into.",
)
@click.option("--name", default="h200-llama3.1-8b", show_default=True, help="Profile name (file stem).")
@click.option("--device", default="cuda", show_default=True, help="torch device to time on.")
@click.option(
    "--tiny", is_flag=True, help="Tiny shapes and grid: a dry run of the whole script (works on CPU)."
)
@click.option(
    "--budget-s",
    type=float,
    default=420.0,
    show_default=True,
    help="Stop taking new measurements after this many seconds and fit what was measured.",
)
@click.option(
    "--compile/--no-compile",
    "fused",
    default=True,
    show_default=True,
    help="Fuse each layer's non-attention work with torch.compile, as vLLM's compiled model does.",
)
@click.option(
    "--refit",
    is_flag=True,
    help="Measure nothing: refit NAME.json from NAME.points.csv and NAME.stack.json in --out.",
)
def main(out: Path, name: str, device: str, tiny: bool, budget_s: float, fused: bool, refit: bool) -> None:
    """Time Llama-3.1-8B-shaped forward passes on this GPU and fit a simulator cost profile."""

    def log(msg: str) -> None:
        click.echo(msg)
        sys.stdout.flush()

    if refit:
        points_path, stack_path = out / f"{name}.points.csv", out / f"{name}.stack.json"
        if not points_path.exists() or not stack_path.exists():
            raise click.ClickException(f"--refit needs {points_path} and {stack_path}")
        stack = json.loads(stack_path.read_text())
        date = str(stack.get("date", ""))[:10]
        profile = build_profile(read_points(points_path), stack, name=name, date=date)
        (out / f"{name}.json").write_text(json.dumps(profile, indent=2) + "\n")
    else:
        # Before torch initialises CUDA: large caches and many graph pools fragment less this way.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        try:
            import torch
        except ImportError as exc:
            raise click.ClickException(
                "calibration needs PyTorch (pip install torch) on the GPU machine"
            ) from exc
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise click.ClickException("no CUDA device is visible; use --device cpu --tiny for a dry run")
        started = time.monotonic()
        # One grad mode for everything: compiled functions would otherwise recompile on the switch.
        with torch.inference_mode():
            profile = run_calibration(out, name, device, tiny, budget_s, log, fused, started)
    log(json.dumps(profile, indent=2))


if __name__ == "__main__":
    main()

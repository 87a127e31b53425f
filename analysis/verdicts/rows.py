"""The verdict table's rows and the settings that shaped them: frozen values, built once with their
verdicts by :mod:`.evaluation`, read by :mod:`.render` and :mod:`.report`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from specproxy.analysis.figures.matched import LoadFigures
from specproxy.analysis.figures.run_figures import LatencyFigures, SummaryFigures
from specproxy.analysis.figures.validity import DroppedRound
from specproxy.analysis.levels import level_load
from specproxy.analysis.slo.answer import SloEvaluation
from specproxy.analysis.stats import Interval
from specproxy.analysis.verdicts.rules import SHADOW_BASIS, Crossover, DeployVerdict, Thresholds
from specproxy.slo import Slo

# The figures a LevelRow carries from its level's summary as they are, one list for every place that
# copies them.
SUMMARY_FIELDS = tuple(f.name for f in fields(SummaryFigures))


@dataclass(frozen=True)
class Settings:
    """Everything `analyze` can be told. ``confidence`` holds for all of an arm's levels at once.

    ``at_concurrency`` / ``peak_concurrency``: where the user runs and their peak (else the run's
    experiment file says, else the analysis assumes the lowest and highest tested levels, whatever
    their health);
    ``at_rate`` / ``peak_rate`` the same in requests/s, for a run of open-loop rate levels.
    ``time_blocks``: the blocks a level of one round (or live traffic) is cut into to see drift.
    ``slo``: the latency targets of goodput and capacity (else the experiment file's, else none);
    ``peak_rate`` / ``gpu_hour_usd``: the peak in requests/s and the price of a GPU-hour, for the fleet
    at the peak (else the experiment file's).
    ``latency_table``: the text and Markdown outputs add the latency table (JSON and CSV always
    carry its figures).
    """

    thresholds: Thresholds = field(default_factory=Thresholds)
    near_tie_margin: float = 0.5
    confidence: float = 0.95
    bootstrap_iterations: int = 1000
    bootstrap_seed: int = 0
    bootstrap_max_sample: int = 2000
    at_concurrency: int | None = None
    peak_concurrency: int | None = None
    at_rate: float | None = None
    peak_rate: float | None = None
    time_blocks: int = 4
    slo: Slo | None = None
    gpu_hour_usd: float | None = None
    latency_table: bool = False  # print the latency table after the verdict table (text, Markdown)
    # the text and Markdown table's columns (keys of :mod:`.render.columns`): () the default ones,
    # ("all",) every one that holds a figure
    columns: tuple[str, ...] = ()
    # where a given peak came from, as the run's title says it (the lab's label when it moved the peak
    # to the highest level it measured soundly)
    peak_source: str = "command line"


@dataclass(frozen=True)
class LevelRow(SummaryFigures):
    """One row of the verdict table: an arm at a level (a concurrency, an offered rate, or live).

    ``rounds``: replay rounds the level is judged on (None: live traffic), ``rounds_used`` which ones,
    ``rounds_measured`` how many it had; when a round failed the measurement's health checks and the
    level is judged without it, ``rounds_dropped`` says which and why (every figure of the row leaves
    them out); ``blocks``: what the intervals' drift term came from;
    ``confidence``: each interval's own level (simultaneous over the levels the arm's deploy verdict
    reads: the operating point's and the peak's);
    ``reliable`` / ``health``: the level's health checks and what failed.
    ``tokens_source``: where this arm's token counts came from (:mod:`.provenance`);
    ``tokens_estimated``: this row's speeds (the arm's own, or the baseline's it is compared with) rest
    on estimated counts, said in ``estimate_note``; ``req_acceptance_source`` says where the per-request
    acceptance figures came from, ``req_acceptance_not_measured`` which calls had none, and why.
    """

    compared: int = 0
    identical: int = 0
    near_tie: int = 0
    gross: int = 0
    margin_unknown: int = 0
    paired: bool | None = None
    pairs: int = 0
    decode_speedup: Interval | None = None
    throughput_speedup: Interval | None = None
    # "wall": agg tok/s ratio (closed-loop replay levels); "per call": Σ tokens / Σ e2e ratio (live
    # traffic, split traffic), where wall-clock rates reflect arrivals and traffic shares, not speed;
    # "shadow": none (shadow copies reach the arm at the baseline's pace: rules.SHADOW_THROUGHPUT)
    throughput_basis: str = "wall"
    verdict: str | None = None
    reason: str = ""
    rounds: int | None = None
    rounds_measured: int | None = None
    rounds_used: tuple[int, ...] = ()
    rounds_dropped: tuple[DroppedRound, ...] = ()
    blocks: str = ""
    drift_note: str = ""
    confidence: float | None = None
    decode_margin: float | None = None
    throughput_margin: float | None = None
    margin_source: str = ""
    identity_mismatch: Interval | None = None
    reliable: bool = True
    health: str = ""
    health_checks: int = 0
    load: LoadFigures | None = None
    unmatched_decode_speedup: Interval | None = None
    unmatched_throughput_speedup: Interval | None = None
    tokens_source: str = ""
    own_tokens_estimated: bool = False
    tokens_estimated: bool = False
    estimate_note: str = ""
    req_acceptance_source: str = ""
    req_acceptance_not_measured: str = ""
    # TPOT, inter-token latency, E2E, queueing and tokens per chunk (None: the arm had no ok call here)
    latency: LatencyFigures | None = None

    @property
    def identical_rate(self) -> float | None:
        return self.identical / self.compared if self.compared else None

    @property
    def shadow(self) -> bool:
        """The arm got shadow copies here: no throughput ratio (``throughput_basis`` "shadow")."""
        return self.throughput_basis == SHADOW_BASIS

    @property
    def level_load(self) -> float | None:
        """The level's load: its concurrency, or its offered rate (req/s); None for live traffic."""
        return level_load(self.level)


@dataclass(frozen=True)
class CategoryRow:
    """A candidate arm on one workload category at one level: the requests of that category only.

    ``throughput_speedup`` is per call (Σ tokens / Σ e2e of the category's calls, candidate over
    baseline): a category has no wall time of its own inside a mixed closed-loop level. The verdict
    uses the category's decode speedup and identity with the LEVEL's aggregate throughput ratio;
    ``set_by_level`` says the level's throughput changed it (the category's own speed and identity
    alone would read otherwise, e.g. a 1.4x category of a level whose throughput fell: LOSS).
    Category intervals are not corrected for the number of categories: they are for exploring.
    """

    arm: str
    category: str
    level: str
    concurrency_level: int | None
    offered_rate: float | None
    paired: bool
    calls: int
    baseline_calls: int
    p50_decode_tok_s: float | None
    baseline_p50_decode_tok_s: float | None
    compared: int = 0
    identical: int = 0
    decode_speedup: Interval | None = None
    throughput_speedup: Interval | None = None
    throughput_basis: str = "per call"
    verdict: str | None = None
    reason: str = ""
    tokens_estimated: bool = False
    set_by_level: bool = False

    @property
    def level_load(self) -> float | None:
        return level_load(self.level)


@dataclass(frozen=True)
class ArmOutcome:
    arm: str
    role: str
    spec_method: str
    kind: str  # baseline | candidate | replica
    crossover: Crossover | None
    crossover_text: str
    deploy: DeployVerdict | None
    compared: int
    mismatched: int
    near_tie: int
    gross: int


@dataclass(frozen=True)
class RunEvaluation:
    run_id: str
    name: str
    mode: str | None
    source: str | None
    started_at: Any
    baseline: str
    peak_level: str
    rows: list[LevelRow]
    arms: list[ArmOutcome]
    categories: list[CategoryRow]
    noise_compared: int
    noise_mismatched: int
    stacks: dict[str, Any]
    notes: list[str]
    at_concurrency: int | None = None
    peak_concurrency: int | None = None
    operating_point: str = ""
    # where the peak was moved to and why, when it was (the lab's label); "" otherwise
    peak_label: str = ""
    at_rate: float | None = None
    peak_rate: float | None = None
    unreliable_levels: list[str] = field(default_factory=list)
    # arms without a single ok call, one sentence each with the first error (`analyze` exits non-zero)
    failed_arms: list[str] = field(default_factory=list)
    # goodput, capacity and fleet at the SLO, when one was given
    slo: SloEvaluation | None = None
    # level → the time scale the lab's simulators ran at there, where not 1 (tok/s scale with it)
    time_scales: dict[str, float] = field(default_factory=dict)

    @property
    def noise_floor(self) -> float | None:
        return self.noise_mismatched / self.noise_compared if self.noise_compared else None

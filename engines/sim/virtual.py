"""The engine on a virtual clock: closed-loop load without sockets or sleeping, exact and fast.

The fidelity bench and the tests use it to hold the engine model against published numbers:

    >>> result = run_closed_loop(SimConfig(), chat_workload(8), concurrency=1, num_requests=4)
    >>> 100 < result.output_tok_s < 200
    True
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from specproxy.engines.profiles import CostProfile, load_profile
from specproxy.engines.sim.config import SimConfig
from specproxy.engines.sim.engine import EngineCore, RequestSpec, Sequence
from specproxy.engines.sim.text import VOCAB, Prompt, chat_prompt, request_key

_QUESTIONS = (
    "Write a short story about a team that has to update a city energy plan before the year ends.",
    "Explain to a new engineer how a cache works and when it is a bad idea to use one.",
    "Compose a persuasive email to convince your friend to join a research study on health.",
    "What are the main differences between a market economy and a planned one? Give examples.",
    "Help me plan a three day trip to a country with mountains, lakes and good public transport.",
    "Describe the process of designing a new school building, from the first plan to the opening.",
    "Imagine you are a government advisor: what policy would you propose to reduce water use?",
    "Give me feedback on this idea: a service that tracks the price of energy every hour.",
)


def article(rng: random.Random, words: int) -> str:
    """Prose-like filler: Zipf-ish words in sentences, the kind of text articles and documents hold."""
    out: list[str] = []
    sentence = 0
    common = VOCAB[:200]
    for _ in range(words):
        word = rng.choice(common) if rng.random() < 0.6 else VOCAB[int(rng.paretovariate(0.9)) % len(VOCAB)]
        if sentence == 0:
            word = word.capitalize()
        out.append(word)
        sentence += 1
        if sentence > 8 and rng.random() < 0.12:
            out[-1] += "."
            sentence = 0
        elif rng.random() < 0.05:
            out[-1] += ","
    return " ".join(out) + "."


def chat_workload(n: int, seed: int = 1) -> list[tuple[Prompt, str]]:
    """MT-bench-like open questions (short prompts, long free answers)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        question = _QUESTIONS[i % len(_QUESTIONS)] + " " + article(rng, rng.randint(10, 60))
        prompts.append((chat_prompt([{"role": "user", "content": question}]), "chat"))
    return prompts


def summarization_workload(n: int, seed: int = 2, words: int = 700) -> list[tuple[Prompt, str]]:
    """CNN/DailyMail-like: summarize an article of ~`words` words."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        text = "Summarize the following article in a few sentences.\n\n" + article(rng, words)
        prompts.append((chat_prompt([{"role": "user", "content": text}]), "summarization"))
    return prompts


@dataclass
class LoadResult:
    requests: int
    output_tokens: int
    duration_s: float
    steps: int
    mean_decode_tok_s: float  # per user: (tokens - 1) / (last token - first token), averaged
    mean_batch: float
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    preemptions: int = 0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def run_closed_loop(
    config: SimConfig,
    workload: list[tuple[Prompt, str]],
    *,
    concurrency: int,
    num_requests: int,
    max_tokens: int = 512,
    ignore_eos: bool = False,
    profile: CostProfile | None = None,
) -> LoadResult:
    """Keep `concurrency` requests in the engine until `num_requests` have finished; virtual time."""
    core = EngineCore(config, profile or load_profile(config.profile))
    now = 0.0
    issued = 0
    done: list[Sequence] = []
    batch_sum = 0

    def issue() -> None:
        nonlocal issued
        prompt, category = workload[issued % len(workload)]
        spec = RequestSpec(
            request_id=f"v{issued}",
            prompt=prompt,
            category=category,
            key=request_key(config.model, prompt.text + f"#{issued // len(workload)}"),
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
        )
        core.add(spec, now)
        issued += 1

    while issued < min(concurrency, num_requests):
        issue()
    while core.has_work():
        plan = core.plan_step(now)
        if plan is None:
            break
        now += plan.duration_s
        batch_sum += len(plan.items)
        for seq in core.finish_step(plan, now):
            if seq.finished:
                done.append(seq)
                if issued < num_requests:
                    issue()
    rates = []
    for seq in done:
        t = seq.truth
        if (
            t.first_token is not None
            and t.finished is not None
            and seq.n_out > 1
            and t.finished > t.first_token
        ):
            rates.append((seq.n_out - 1) / (t.finished - t.first_token))
    m = core.metrics
    return LoadResult(
        requests=len(done),
        output_tokens=sum(s.n_out for s in done),
        duration_s=now,
        steps=core.steps,
        mean_decode_tok_s=sum(rates) / len(rates) if rates else 0.0,
        mean_batch=batch_sum / core.steps if core.steps else 0.0,
        num_drafts=m.spec_drafts,
        draft_tokens=m.spec_draft_tokens,
        accepted_tokens=m.spec_accepted,
        preemptions=m.preemptions,
    )

"""The lab's built-in mixed workload: five kinds of request, generated here, the same on every machine.

    chat            a short open question                       (little for n-gram to copy)
    summarization   a news-style article to summarise           (the answer reuses the article's phrases)
    code_edit       a Python module and a change to make in it   (the answer is mostly the code again)
    extraction      a record-like document and fields to pull    (the answer copies values verbatim)
    rag_qa          retrieved passages and a question            (the answer quotes a passage)

Items come round-robin by category, so any prefix of the list is balanced. The text is synthetic but
deterministic (seeded), so two runs of `specproxy lab` send byte-identical requests. Each item carries
its category, which replay sends as the ``X-Specproxy-Category`` header; the simulator uses it to decide
how much of the prompt the answer copies.

Example::

    items = mixed_workload(50)          # 10 of each category, ReplayItem objects
    items[1].category, items[1].body["max_tokens"]
"""

from __future__ import annotations

import random
from collections.abc import Callable

from specproxy.proxy.replay.formats import ReplayItem

CATEGORIES: tuple[str, ...] = ("chat", "summarization", "code_edit", "extraction", "rag_qa")

# Output lengths per category (tokens): long enough that decode dominates, as in the published labs.
MAX_TOKENS: dict[str, int] = {
    "chat": 160,
    "summarization": 128,
    "code_edit": 160,
    "extraction": 96,
    "rag_qa": 112,
}

_SUBJECTS = (
    "the council",
    "the research team",
    "the company",
    "local officials",
    "the committee",
    "investors",
    "the agency",
    "engineers",
    "the hospital",
    "the university",
    "residents",
)
_VERBS = (
    "announced",
    "reported",
    "approved",
    "delayed",
    "reviewed",
    "expanded",
    "questioned",
    "confirmed",
    "rejected",
    "proposed",
    "measured",
    "published",
)
_OBJECTS = (
    "a new transit plan",
    "the annual budget",
    "a water treatment upgrade",
    "quarterly results",
    "a revised safety policy",
    "the data center project",
    "a housing program",
    "the trial results",
    "an energy storage contract",
    "the network outage report",
    "a scholarship fund",
)
_DETAILS = (
    "after months of debate",
    "despite strong objections",
    "ahead of the winter season",
    "following an independent audit",
    "with support from regional partners",
    "at a cost of about 40 million dollars",
    "in a vote of seven to two",
    "citing rising demand",
    "to the surprise of many observers",
    "under a tight deadline",
)
_TOPICS = (
    "databases",
    "gardening",
    "the history of Rome",
    "learning a language",
    "photography",
    "marathon training",
    "home networking",
    "baking bread",
    "chess openings",
    "climate science",
)
_ASKS = (
    "What should a beginner know about",
    "Can you explain the basics of",
    "Give me three practical tips about",
    "Why do people find it hard to get started with",
    "What are common misconceptions about",
)
_NAMES = (
    "Alice Moreno",
    "Bilal Chaudhry",
    "Chen Wei",
    "Dana Kowalski",
    "Emeka Obi",
    "Freya Lund",
    "Gustavo Reis",
    "Hana Sato",
    "Ivan Petrov",
    "Julia Brandt",
)
_CITIES = ("Lisbon", "Osaka", "Nairobi", "Toronto", "Kraków", "Austin", "Lyon", "Pune", "Perth", "Bergen")
_FUNCS = (
    "parse_header",
    "load_config",
    "merge_records",
    "retry_request",
    "normalize_path",
    "compute_checksum",
    "render_table",
    "split_batches",
    "validate_email",
    "rotate_logs",
)


def _sentence(rng: random.Random) -> str:
    return (
        f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
        f"{rng.choice(_DETAILS)}."
    )


def _paragraphs(rng: random.Random, n_par: int, n_sent: int) -> str:
    return "\n\n".join(" ".join(_sentence(rng) for _ in range(n_sent)) for _ in range(n_par))


def _chat(rng: random.Random) -> str:
    return f"{rng.choice(_ASKS)} {rng.choice(_TOPICS)}? Please answer in a few paragraphs."


def _summarization(rng: random.Random) -> str:
    article = _paragraphs(rng, 6, 6)
    return f"Summarize the following article in one paragraph, keeping the key facts.\n\n{article}"


def _python_function(rng: random.Random, name: str) -> str:
    arg = rng.choice(("items", "path", "payload", "rows", "text"))
    limit = rng.randint(2, 64)
    return (
        f"def {name}({arg}, limit={limit}):\n"
        f'    """{rng.choice(_VERBS).capitalize()} {arg} for {rng.choice(_OBJECTS)}."""\n'
        f"    result = []\n"
        f"    for index, value in enumerate({arg}):\n"
        f"        if index >= limit:\n"
        f"            break\n"
        f"        if value is None:\n"
        f"            continue\n"
        f"        result.append(str(value).strip())\n"
        f"    return result\n"
    )


def _code_edit(rng: random.Random) -> str:
    names = rng.sample(_FUNCS, 4)
    module = "\n\n".join(_python_function(rng, n) for n in names)
    target = names[rng.randrange(len(names))]
    return (
        f"Here is a Python module:\n\n```python\n{module}```\n\nRename the argument `limit` to "
        f"`max_items` in `{target}` and return the whole module with the change applied."
    )


def _extraction(rng: random.Random) -> str:
    records = []
    for i in range(6):
        name = rng.choice(_NAMES)
        records.append(
            f"Record {i + 1}: {name} joined in {rng.randint(2001, 2024)}, lives in {rng.choice(_CITIES)}, "
            f"account {rng.randint(100000, 999999)}, balance {rng.randint(100, 99999)}.{rng.randint(10, 99)} "
            f"EUR, contact {name.split()[0].lower()}@example.org. {_sentence(rng)}"
        )
    return "Extract name, city, account number and email from each record as JSON lines.\n\n" + "\n".join(
        records
    )


def _rag_qa(rng: random.Random) -> str:
    passages = "\n\n".join(f"[{i + 1}] {_paragraphs(rng, 1, 5)}" for i in range(4))
    subject = rng.choice(_SUBJECTS)
    return (
        f"Answer the question using only the passages below, quoting the passage you rely on.\n\n"
        f"{passages}\n\nQuestion: what did {subject} do, and why?"
    )


_GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "chat": _chat,
    "summarization": _summarization,
    "code_edit": _code_edit,
    "extraction": _extraction,
    "rag_qa": _rag_qa,
}


def mixed_workload(n_items: int, seed: int = 0, max_tokens_scale: float = 1.0) -> list[ReplayItem]:
    """``n_items`` chat requests, categories round-robin; the same list for the same arguments.

    ``max_tokens_scale`` shortens (or lengthens) every answer alike, for quick runs.
    """
    items: list[ReplayItem] = []
    for i in range(n_items):
        category = CATEGORIES[i % len(CATEGORIES)]
        rng = random.Random(f"specproxy-workload:{seed}:{i}")
        prompt = _GENERATORS[category](rng)
        max_tokens = max(8, round(MAX_TOKENS[category] * max_tokens_scale))
        items.append(
            ReplayItem(
                item_id=f"{category}-{i:04d}",
                endpoint="chat",
                body={"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens},
                category=category,
                where=f"workload:{i}",
            )
        )
    return items

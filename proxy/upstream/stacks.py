"""What each arm says about itself, for the run record: its version, models and captured stack."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import aiohttp

from specproxy.config import Arm, Experiment
from specproxy.engine_state import recorded_stacks
from specproxy.proxy.upstream.engines import engine_of_models


def arm_auth(arm: Arm) -> dict[str, str]:
    key = os.environ.get(arm.api_key_env) if arm.api_key_env else None
    return {"Authorization": f"Bearer {key}"} if key else {}


async def arm_stacks(
    session: aiohttp.ClientSession,
    exp: Experiment,
    timeout_s: float = 3.0,
    *,
    engines: dict[str, str] | None = None,
) -> str:
    """Each arm's stack for ``runs.stacks_json``: GET /version and /v1/models (failures recorded, not
    raised), its speculative config and description, and what `specproxy engines up` recorded.

    ``engines``: arm URL → engine, filled in where an arm's /v1/models names its engine (an
    :class:`UpstreamState`'s ``engines``, so the first call already speaks that engine's dialect)."""
    try:
        engine_stacks = recorded_stacks(exp)
    except Exception:  # the engines state is optional context; never a reason not to serve
        engine_stacks = {}

    async def get(url: str, headers: dict[str, str]) -> tuple[Any, str | None]:
        try:
            async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status >= 400:
                    return None, f"HTTP {r.status}"
                return await r.json(content_type=None), None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            return None, f"{exc.__class__.__name__}: {exc}"

    async def one(arm: Arm) -> tuple[str, dict[str, Any]]:
        headers = arm_auth(arm)
        (version, verr), (models_, merr) = await asyncio.gather(
            get(f"{arm.url}/version", headers), get(f"{arm.url}/v1/models", headers)
        )
        detected = engine_of_models(models_)
        if engines is not None and detected is not None:
            engines.setdefault(arm.url, detected)
        return arm.name, {
            "url": arm.url,
            "role": arm.role,
            "speculative": dict(arm.speculative),
            "description": arm.description,
            "version": version.get("version") if isinstance(version, dict) else None,
            "models": models_,
            "errors": {k: v for k, v in (("version", verr), ("models", merr)) if v},
            "engine": engine_stacks.get(arm.name),
        }

    pairs = await asyncio.gather(*(one(a) for a in exp.arms))
    return json.dumps(dict(pairs), sort_keys=True, default=str)

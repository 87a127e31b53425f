"""The vLLM-shaped simulator behind `specproxy sim`.

Modules, from the outside in:

- `cli`: the `specproxy sim` click command (flags -> `SimConfig`, serve until SIGTERM).
- `server`: vLLM 0.33's HTTP API over the engine; `create_sim_app(config)` and `running_sim(config)`.
- `api_request`, `api_response`: request validation with vLLM's wording; vLLM's response and chunk JSON.
- `engine`: `EngineCore` (continuous batching, step pricing, verification, ground truth) and
  `SimEngine` (the core on the asyncio clock, `--time-scale`).
- `proposers`: n-gram and suffix lookups, per-method acceptance rates.
- `text`: the word tokenizer, chat template ids, and the target model's deterministic token stream.
- `prefix_cache`: vLLM-style automatic prefix caching.
- `metrics`: the `vllm:*` Prometheus series.
- `virtual`: the engine on a virtual clock (closed-loop load without sockets) for benches and tests.
- `config`: `SimConfig`, `SpeculativeConfig` (vLLM's JSON), `Faults`.

Cost profiles live in `specproxy.engines.profiles`.
"""

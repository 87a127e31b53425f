"""deploy/ checked offline, as CI can: YAML parses, the compose files validate against the Compose
Specification's JSON schema, manifests against the Kubernetes schemas, the dashboard loads and asks
for metrics that exist, the Dockerfile parses into a slim, non-root image with a healthcheck — and
the arms in the deploy files are exactly what `specproxy engines plan` renders for
deploy/experiment.toml."""

from __future__ import annotations

import importlib.resources
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

try:
    import jsonschema
    import kubernetes_validate
    from dockerfile_parse import DockerfileParser
except ModuleNotFoundError as missing:
    pytest.skip(
        f"{missing.name} is not installed: the deploy checks need the deploy-validation dependency group "
        "(pip install --group deploy-validation)",
        allow_module_level=True,
    )

from specproxy.cli import main
from specproxy.config import load_experiment, parse_experiment
from specproxy.engines.launch.render import compose_document, render_k8s
from specproxy.engines.launch.validate import check_experiment
from specproxy.engines.sim.metrics import EngineMetrics
from specproxy.proxy.server.metrics import ProxyMetrics

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_FILES = {"vllm": DEPLOY / "docker-compose.yml", "sim": DEPLOY / "docker-compose.sim.yml"}
K8S_VERSIONS = ("1.29", "1.33")


def _yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _experiment() -> Any:
    return load_experiment(DEPLOY / "experiment.toml")


@pytest.fixture(scope="module")
def compose_schema() -> jsonschema.protocols.Validator:
    # check-jsonschema vendors the Compose Specification's schema (compose-spec/compose-spec).
    pytest.importorskip("check_jsonschema", reason="the deploy-validation dependency group is not installed")
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads((vendored / "compose-spec.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_every_yaml_file_parses() -> None:
    files = sorted(DEPLOY.rglob("*.y*ml"))
    assert len(files) >= 8
    for path in files:
        assert _yaml_docs(path), f"{path} is empty"


def test_the_deploy_experiment_is_launchable() -> None:
    exp = _experiment()
    assert [a.name for a in exp.arms] == ["baseline", "ngram", "eagle3"]
    assert exp.mode == "shadow"
    assert [f for f in check_experiment(exp, local=False) if f.level == "error"] == []


@pytest.mark.parametrize("variant", sorted(COMPOSE_FILES))
def test_compose_file_is_valid_compose(variant: str, compose_schema: jsonschema.protocols.Validator) -> None:
    doc = yaml.safe_load(COMPOSE_FILES[variant].read_text())
    errors = sorted(compose_schema.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    # Files mounted from the repository exist next to the compose file.
    for name, svc in doc["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_FILES[variant].parent / source).exists(), f"{name}: {source} is missing"
        for dep in svc.get("depends_on", {}):
            assert dep in doc["services"], f"{name} depends on unknown service {dep}"


def test_the_schema_check_catches_mistakes(compose_schema: jsonschema.protocols.Validator) -> None:
    doc = yaml.safe_load(COMPOSE_FILES["vllm"].read_text())
    doc["services"]["arm-ngram"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] = "gpu"
    doc["services"]["specproxy"]["restart_policy"] = "always"
    assert len(list(compose_schema.iter_errors(doc))) >= 2


@pytest.mark.parametrize("engine", ["vllm", "sim"])
def test_compose_arms_are_the_engines_plan(engine: str) -> None:
    committed = yaml.safe_load(COMPOSE_FILES[engine].read_text())
    rendered = compose_document(_experiment(), engine=engine)  # type: ignore[arg-type]
    for name, service in rendered["services"].items():
        if name == "specproxy":
            assert committed["services"][name]["command"] == service["command"]
            assert committed["services"][name]["healthcheck"] == service["healthcheck"]
            assert "/ready" in " ".join(service["healthcheck"]["test"])  # readiness, not liveness
            continue
        assert committed["services"][name] == service, f"{name} differs from `engines plan --format compose`"
    assert committed["configs"] == rendered["configs"]


def test_vllm_compose_stack() -> None:
    doc = yaml.safe_load(COMPOSE_FILES["vllm"].read_text())
    services = doc["services"]
    assert {
        "arm-baseline",
        "arm-ngram",
        "arm-eagle3",
        "specproxy",
        "otel-collector",
        "prometheus",
        "grafana",
    } <= set(services)
    gpu_ids = []
    for arm in ("arm-baseline", "arm-ngram", "arm-eagle3"):
        svc = services[arm]
        assert svc["image"].startswith("vllm/vllm-openai:")
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        gpu_ids += device["device_ids"]
    assert sorted(gpu_ids) == ["0", "1", "2"]
    spec = {
        a: json.loads(
            services[f"arm-{a}"]["command"][services[f"arm-{a}"]["command"].index("--speculative-config") + 1]
        )["method"]
        for a in ("ngram", "eagle3")
    }
    assert spec == {"ngram": "ngram", "eagle3": "eagle3"}
    inner = parse_experiment(tomllib.loads(doc["configs"]["experiment"]["content"]))
    assert inner.mode == "shadow"
    assert services["specproxy"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"


def test_sim_compose_needs_no_gpu() -> None:
    doc = yaml.safe_load(COMPOSE_FILES["sim"].read_text())
    for name, svc in doc["services"].items():
        assert "deploy" not in svc, f"{name} reserves a device"
        assert "vllm/vllm-openai" not in svc.get("image", "")
    assert doc["services"]["arm-eagle3"]["command"][0] == "sim"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_validate(version: str) -> None:
    kinds = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in _yaml_docs(path):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {exc.message}")
            kinds.append((doc["kind"], doc["metadata"]["name"]))
    for arm in ("baseline", "ngram", "eagle3"):
        assert ("Deployment", f"arm-{arm}") in kinds and ("Service", f"arm-{arm}") in kinds
    for kind in ("ConfigMap", "HorizontalPodAutoscaler", "PodDisruptionBudget"):
        assert any(k == kind for k, _ in kinds), kind
    assert ("Deployment", "specproxy") in kinds and ("Deployment", "otel-collector") in kinds


def test_the_k8s_check_catches_mistakes() -> None:
    doc = next(d for d in _yaml_docs(DEPLOY / "k8s" / "specproxy.yaml") if d["kind"] == "Deployment")
    doc["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def test_k8s_specproxy_yaml_is_the_engines_plan() -> None:
    assert (DEPLOY / "k8s" / "specproxy.yaml").read_text() == render_k8s(_experiment())


def test_k8s_gpu_requests_and_proxy_shape() -> None:
    docs = _yaml_docs(DEPLOY / "k8s" / "specproxy.yaml")
    arms = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("arm-")]
    assert len(arms) == 3
    for d in arms:
        limits = d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"
    proxy = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "specproxy")
    pod = proxy["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    assert pod["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "specproxy" and hpa["spec"]["minReplicas"] >= 2
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == proxy["spec"]["selector"]["matchLabels"]


def test_otel_collector_config() -> None:
    config = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    kinds = ("receivers", "processors", "exporters", "connectors")
    defined = {kind: set(config.get(kind, {})) for kind in kinds}
    for name, pipeline in config["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                known = defined[kind] | defined["connectors"]
                assert component in known, f"{name}: {component} is not defined"
    cm = next(d for d in _yaml_docs(DEPLOY / "k8s" / "otel-collector.yaml") if d["kind"] == "ConfigMap")
    assert cm["data"]["config.yaml"] == (DEPLOY / "otel-collector.yaml").read_text()


def test_prometheus_scrapes_every_arm_under_its_name() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    arm_targets = {c["labels"]["arm"]: c["targets"][0] for c in jobs["arms"]["static_configs"]}
    exp = _experiment()
    compose = yaml.safe_load(COMPOSE_FILES["vllm"].read_text())
    for arm in exp.arms:
        host, port = arm_targets[arm.name].split(":")
        assert host in compose["services"] and port in compose["services"][host]["expose"]
    assert jobs["specproxy"]["static_configs"][0]["targets"] == ["specproxy:8000"]


def _series_names(text: str) -> set[str]:
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            names |= {f"{family.name}_total", f"{family.name}_created"}
        elif family.type == "histogram":
            names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
        else:
            names.add(family.name)
    return names


def test_dashboard_loads_and_asks_for_metrics_that_exist() -> None:
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "specproxy.json").read_text())
    assert dash["uid"] == "specproxy"
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("ttft", "decode tok/s", "acceptance rate", "identity mismatches", "shadow drops"):
        assert topic in titles, topic
    proxy = ProxyMetrics({}, {"baseline": "http://b"}, lambda: (0, 0, 0)).render().decode()
    engine = EngineMetrics("m", 3)
    known = _series_names(proxy) | _series_names(engine.render(engine.registry()).decode())
    used = {m for e in exprs for m in re.findall(r"\b(specproxy_[a-z_]+|vllm:[a-z_]+)", e)}
    assert used and used <= known, f"unknown series: {sorted(used - known)}"
    # Provisioning: the data source the panels name, and the folder the provider reads.
    provisioning = DEPLOY / "grafana" / "provisioning"
    ds = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    uids = {p["datasource"]["uid"] for p in dash["panels"] if "datasource" in p}
    assert uids == {ds["datasources"][0]["uid"]}
    provider = yaml.safe_load((provisioning / "dashboards" / "specproxy.yaml").read_text())
    mounts = yaml.safe_load(COMPOSE_FILES["vllm"].read_text())["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['providers'][0]['options']['path']}:ro" in mounts


def test_dockerfile_is_slim_non_root_with_a_healthcheck() -> None:
    parser = DockerfileParser(str(DEPLOY / "Dockerfile"))
    instructions = [(i["instruction"], i["value"]) for i in parser.structure]
    froms = [v for k, v in instructions if k == "FROM"]
    assert froms and all("-slim" in f for f in froms)
    final = instructions[max(i for i, (k, _) in enumerate(instructions) if k == "FROM") :]
    users = [v for k, v in final if k == "USER"]
    assert users and not users[-1].startswith(("root", "0"))
    assert any(k == "HEALTHCHECK" and "/health" in v for k, v in instructions) or any(
        k == "ENV" and "/health" in v for k, v in final
    )
    assert any(k == "HEALTHCHECK" for k, _ in final)
    assert json.loads(next(v for k, v in final if k == "ENTRYPOINT")) == ["specproxy"]
    copied = set()
    for k, v in instructions:
        if k == "COPY" and not v.startswith("--"):
            source = v.split()[0]
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            copied.add(source.rstrip("/"))
    # the wheel is built from the copied tree: every installed subpackage's folder must be in it
    rooms = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["specproxy"]["subpackages"]
    assert {"specproxy", *rooms} <= copied, copied
    assert (DEPLOY / "Dockerfile.dockerignore").exists()


def test_the_image_has_the_otlp_extra_the_deployments_export_with() -> None:
    # Compose and Kubernetes point specproxy at an OpenTelemetry Collector; OTLP export needs the otlp
    # extra (without it serve refuses to start), so the image must build specproxy with it.
    services = yaml.safe_load(COMPOSE_FILES["vllm"].read_text())["services"]
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in services["specproxy"]["environment"]
    k8s_env = [
        e["name"]
        for doc in _yaml_docs(DEPLOY / "k8s" / "specproxy.yaml")
        if doc.get("kind") in ("Deployment", "StatefulSet")
        for c in doc["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
    ]
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in k8s_env
    parser = DockerfileParser(str(DEPLOY / "Dockerfile"))
    builds = [v for i in parser.structure if i["instruction"] == "RUN" and "pip wheel" in (v := i["value"])]
    assert builds and all(re.search(r"'\.\[(\w+,)*otlp(,\w+)*\]'", v) for v in builds), builds
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("opentelemetry-exporter-otlp-proto-http") for d in extras["otlp"])


def test_the_image_smoke_tests_what_it_installed() -> None:
    # The final stage runs CI's smoke test of an installed specproxy, as the image's user, from the
    # build context; the context lets the script in, and the wheel's license file.
    parser = DockerfileParser(str(DEPLOY / "Dockerfile"))
    instructions = [(i["instruction"], i["value"]) for i in parser.structure]
    final = instructions[max(i for i, (k, _) in enumerate(instructions) if k == "FROM") :]
    smoke = [i for i, (k, v) in enumerate(final) if k == "RUN" and "cli_smoke.py" in v]
    user = max(i for i, (k, _) in enumerate(final) if k == "USER")
    assert smoke and smoke[0] > user, "no smoke test after the image's USER"
    assert "source=.ci/cli_smoke.py" in final[smoke[0]][1]
    assert (ROOT / ".ci" / "cli_smoke.py").is_file()
    allowed = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert {"!.ci/cli_smoke.py", "!LICENSE"} <= set(allowed)


def test_the_readme_arm_fields_are_ones_the_experiment_file_takes() -> None:
    """deploy/README.md's advice names arm fields (`name = value`); an experiment file with them loads."""
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    fields = re.findall(r"give the arm\s+`(\w+ = \w+)`", text)
    assert fields, "the README no longer names an arm field"
    arm = "\n".join(field.replace("= N", "= 2") for field in fields)
    parse_experiment(
        tomllib.loads(f'[[arms]]\nname = "base"\nrole = "baseline"\nurl = "http://h:1"\n{arm}\n')
    )


def test_the_readme_plan_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/README.md's `engines plan` lines, on deploy/experiment.toml as `my-exp.toml`, write the
    files they name, and those parse as YAML."""
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(specproxy engines plan .*?)```", text, re.S)
    assert block, "the README no longer shows `engines plan`"
    (tmp_path / "my-exp.toml").write_text((DEPLOY / "experiment.toml").read_text())
    monkeypatch.chdir(tmp_path)
    for line in block.group(1).splitlines():
        argv = shlex.split(line.split("#", 1)[0])
        done = CliRunner().invoke(main, argv[1:], catch_exceptions=False)
        assert done.exit_code == 0, (line, done.output)
        written = tmp_path / argv[argv.index("-o") + 1]
        assert list(yaml.safe_load_all(written.read_text())), line

"""The deployment files agree with the code and with each other.

There is no Docker engine, Kubernetes cluster or Grafana here, so these tests check
what can be checked without one: every file parses; promtool and amtool accept the
Prometheus and Alertmanager configs; every command line in them is one the torshmon
CLI accepts; every referenced file, port, path, volume and secret exists and matches
the defaults in the code; the generated files (dashboards, rule file) are up to date.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client import CollectorRegistry

from torshmon.agent.daemon import AgentSettings
from torshmon.agent.metrics import AgentMetrics
from torshmon.aggregator.core.promrules import to_prometheus
from torshmon.aggregator.core.rules import alert_name
from torshmon.aggregator.rule_files import default_rules
from torshmon.aggregator.service import Aggregator
from torshmon.aggregator.settings import DEFAULT_PORT, AggregatorSettings
from torshmon.cli import build_parser
from torshmon.wire import GpuSample, InterfaceSample, NodeSample, RankProcess

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "agent" / "Dockerfile"
SYSTEMD_UNIT = ROOT / "agent" / "torshmon-agent.service"
K8S = ROOT / "agent" / "k8s" / "torchrun-with-agent.yaml"
ALERTMANAGER_PORT = 9093
PROMETHEUS_PORT = 9090
#: Grafana's own variables, substituted by Grafana itself.
GRAFANA_VARIABLES = frozenset({"__rate_interval", "__interval", "__range", "__all"})


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def build() -> ModuleType:
    return load_module(ROOT / "dashboards" / "build.py", "torshmon_dashboards_build")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = compose["services"]
    return result


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted((ROOT / "dashboards").glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) of every PromQL query: panel targets and annotations."""
    found = [
        (f"{dashboard['uid']}/{panel['title']}/{target['refId']}", target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
    ]
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            found.append(
                (f"{dashboard['uid']}/annotation {annotation['name']}", annotation["expr"])
            )
    return found


def substitute(expr: str) -> str:
    """An expression as Grafana sends it for one job, all nodes and ranks."""
    values = {
        "job": "demo",
        "node": "(n1|n2)",
        "rank": "(0|1)",
        "op": "(all_reduce)",
        "__rate_interval": "20s",
        "__interval": "5s",
        "__range": "30m",
    }
    return re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)


def agent_sample_names() -> set[str]:
    """Every sample name the agent's /metrics can carry (a GPU node serving a rank)."""
    registry = CollectorRegistry()
    agent = AgentMetrics(registry, node="n1")
    agent.observe_node(
        NodeSample(
            ts_unix_ns=0,
            node="n1",
            cpu_utilization_ratio=0.5,
            memory_utilization_ratio=0.5,
            memory_used_bytes=1,
            io_wait_ratio=0.0,
            net_rx_bytes_total=0,
            net_tx_bytes_total=0,
            disk_read_bytes_total=0,
            disk_write_bytes_total=0,
            gpus=[
                GpuSample(index=0, utilization_ratio=1.0, memory_used_bytes=1, memory_total_bytes=2)
            ],
            ranks=[RankProcess(job="demo", rank=0, pid=1, rss_bytes=1)],
            interfaces=[InterfaceSample(name="eth0", rx_bytes_total=1, tx_bytes_total=1)],
        )
    )
    return _sample_names(registry)


def aggregator_sample_names() -> set[str]:
    """Every sample name the aggregator's /metrics can carry."""
    aggregator = Aggregator(
        AggregatorSettings(db_url="sqlite://", aggregator_id="t"),
        registry=CollectorRegistry(),
        targets=[],
    )
    try:
        return _sample_names(aggregator.registry)
    finally:
        aggregator.writer.shutdown()


def exported_sample_names() -> set[str]:
    return agent_sample_names() | aggregator_sample_names()


def _sample_names(registry: CollectorRegistry) -> set[str]:
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count")}
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\btorshmon_[a-z0-9_]+", expr))


# -- generated files ------------------------------------------------------------------------


def test_rule_file_is_the_export_of_the_default_rules() -> None:
    shipped = (DEPLOY / "torshmon-rules.yml").read_text()
    assert shipped == to_prometheus(default_rules()), (
        "deploy/torshmon-rules.yml is stale: run "
        "torshmon rules export --format prometheus > deploy/torshmon-rules.yml"
    )


def test_dashboards_are_generated_by_build_py(build: ModuleType) -> None:
    expected: dict[str, str] = build.files()
    on_disk = {p.name: p.read_text() for p in (ROOT / "dashboards").glob("*.json")}
    assert set(on_disk) == set(expected), "a dashboard file is missing or not generated"
    stale = [name for name, text in expected.items() if on_disk[name] != text]
    assert not stale, f"stale dashboards {stale}: run python dashboards/build.py"
    assert len(expected) == 6


def test_build_check_mode_reports_a_stale_file(build: ModuleType, tmp_path: Path) -> None:
    assert build.main(["--out", str(tmp_path)]) == 0
    assert build.main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "ddp.json").write_text("{}")
    assert build.main(["--out", str(tmp_path), "--check"]) == 1


def test_build_refuses_a_query_on_a_metric_outside_the_catalogue(build: ModuleType) -> None:
    build.check_metrics({"expr": "rate(torshmon_step_duration_seconds_bucket[1m])"}, "a.json")
    with pytest.raises(ValueError, match=r"a\.json: torshmon_nope not in torshmon\.catalogue"):
        build.check_metrics({"panels": [{"expr": "sum(torshmon_nope)"}]}, "a.json")


# -- dashboards -----------------------------------------------------------------------------


def test_dashboards_are_grafana_10_models_templated_by_job_node_rank() -> None:
    uids = set()
    for name, board in dashboards().items():
        assert board["schemaVersion"] >= 36, name
        assert board.get("id") is None, f"{name}: an exported dashboard must not pin its id"
        assert board["uid"] not in uids and len(board["uid"]) <= 40
        uids.add(board["uid"])
        names = [v["name"] for v in board["templating"]["list"]]
        assert names[:4] == ["datasource", "job", "node", "rank"], name
        ids = [p["id"] for p in panels(board)]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in panels(board):
            pos = panel["gridPos"]
            assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, (name, panel["title"])
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], (name, panel["title"])
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))
        used = {m for _, e in expressions(board) for m in re.findall(r"\$(\w+)", e)}
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                used |= set(re.findall(r"\$(\w+)", var["definition"]))
        undefined = used - set(names) - GRAFANA_VARIABLES
        assert not undefined, f"{name}: undefined variables {undefined}"


def test_no_two_panels_overlap() -> None:
    for name, board in dashboards().items():
        cells: dict[tuple[int, int], str] = {}
        for panel in panels(board):
            pos = panel["gridPos"]
            for x in range(pos["x"], pos["x"] + pos["w"]):
                for y in range(pos["y"], pos["y"] + pos["h"]):
                    assert (x, y) not in cells, f"{name}: {panel['title']} overlaps {cells[x, y]}"
                    cells[x, y] = panel["title"]


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool parses every expression of a rule file; a recording rule per query
    # makes it check the dashboards' PromQL without a Prometheus server.
    rules = []
    for board in dashboards().values():
        for index, (_, expr) in enumerate(expressions(board)):
            rules.append(
                {
                    "record": f"dashboard:{board['uid'].replace('-', '_')}:{index}",
                    "expr": substitute(expr),
                }
            )
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                match = re.fullmatch(r"label_values\((.*), (\w+)\)", var["definition"])
                assert match, f"unexpected variable query {var['definition']}"
                rules.append(
                    {
                        "record": f"variable:{board['uid'].replace('-', '_')}:{var['name']}",
                        "expr": substitute(match[1]),
                    }
                )
    path = tmp_path / "dashboards.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    done = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules)} rules found" in done.stdout, done.stdout + done.stderr


def test_dashboards_use_only_exported_metrics() -> None:
    exported = exported_sample_names()
    used: dict[str, str] = {}
    for board in dashboards().values():
        for where, expr in expressions(board):
            for name in metric_names(expr):
                used.setdefault(name, where)
        for var in board["templating"]["list"]:
            for name in metric_names(var.get("definition", "")):
                used.setdefault(name, f"{board['uid']} variable {var['name']}")
    unknown = {n: w for n, w in used.items() if n not in exported}
    assert not unknown, f"dashboards query metrics nothing exports: {unknown}"
    tuner = {"torshmon_tuner_trials_total", "torshmon_tuner_best_score", "torshmon_tuner_state"}
    assert set(used) >= tuner


# -- Prometheus and Alertmanager ------------------------------------------------------------


def test_promtool_accepts_the_prometheus_config_and_rules() -> None:
    for args in (
        ["check", "config", str(DEPLOY / "prometheus.yml")],
        ["check", "rules", str(DEPLOY / "torshmon-rules.yml")],
    ):
        done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_amtool_accepts_the_alertmanager_config() -> None:
    done = subprocess.run(
        ["amtool", "check-config", str(DEPLOY / "alertmanager.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 receivers" in done.stdout


def test_alertmanager_groups_like_the_aggregator_and_routes_to_slack() -> None:
    config = yaml.safe_load((DEPLOY / "alertmanager.yml").read_text())
    route = config["route"]
    # notify.group_alerts groups by (alertname, job): one Slack thread per problem.
    assert route["group_by"] == ["alertname", "job"]
    receivers = {r["name"]: r for r in config["receivers"]}
    assert route["receiver"] in receivers
    assert all(r.get("receiver", route["receiver"]) in receivers for r in route["routes"])
    assert receivers["slack"]["slack_configs"][0]["send_resolved"] is True
    # Inhibition matchers must name alerts that exist, as both sources name them.
    names = {alert_name(rule.name) for rule in default_rules()}
    for rule in config["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            pattern = re.fullmatch(r'alertname=~?"(.*)"', matcher)
            assert pattern, matcher
            alternatives = pattern[1].split("|")
            assert set(alternatives) <= names, f"{matcher} names an alert no rule has"


def test_the_scrape_config_needs_no_relabelling() -> None:
    """Each series has one exporter (only build_info comes from both, told apart by
    its daemon label), so the shipped config scrapes both daemons as they are."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    for job in config["scrape_configs"]:
        assert "metric_relabel_configs" not in job and "relabel_configs" not in job, job
    agent = {n for n in agent_sample_names() if not n.endswith("_created")}
    aggregator = {n for n in aggregator_sample_names() if not n.endswith("_created")}
    assert agent & aggregator == {"torshmon_build_info"}
    assert "torshmon_agent_forward_up" in agent


# -- docker-compose.yml ---------------------------------------------------------------------


def torshmon_args(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source of each volume entry."""
    result = {}
    for entry in service.get("volumes", []):
        source, target, *_ = entry.split(":")
        result[target] = source
    return result


def published(service: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """Container port -> (host address, host port)."""
    result = {}
    for entry in service.get("ports", []):
        host, host_port, container_port = entry.split(":")
        result[int(container_port)] = (host, int(host_port))
    return result


def test_compose_has_the_whole_stack(compose: dict[str, Any]) -> None:
    assert set(services(compose)) == {
        "postgres",
        "aggregator",
        "agent",
        "trainer",
        "prometheus",
        "alertmanager",
        "grafana",
    }
    declared_volumes = set(compose["volumes"])
    declared_secrets = set(compose["secrets"])
    for name, service in services(compose).items():
        for dependency in service.get("depends_on", []):
            assert dependency in services(compose), (name, dependency)
        for target, source in mounts(service).items():
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in declared_volumes, f"{name} mounts undeclared volume {source}"
            assert target.startswith("/")
        for secret in service.get("secrets", []):
            assert secret in declared_secrets
        for host, _ in published(service).values():
            assert host == "127.0.0.1", f"{name} publishes beyond loopback"
        if "build" in service:
            assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file()


def test_compose_torshmon_commands_are_accepted_by_the_cli(compose: dict[str, Any]) -> None:
    parser = build_parser()
    aggregator = torshmon_args(services(compose)["aggregator"])
    args = parser.parse_args(aggregator)
    assert args.command == "aggregator" and args.port == DEFAULT_PORT == 9470
    assert published(services(compose)["aggregator"]) == {9470: ("127.0.0.1", 9470)}
    agent = torshmon_args(services(compose)["agent"])
    args = parser.parse_args(agent)
    assert args.command == "agent"
    assert args.metrics_port == AgentSettings().metrics_port == 9465
    assert published(services(compose)["agent"]) == {9465: ("127.0.0.1", 9465)}
    assert urlsplit(args.aggregator).netloc == "aggregator:9470"


def test_compose_environment_names_are_ones_torshmon_reads(compose: dict[str, Any]) -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "torshmon").rglob("*.py"))
    for name in ("aggregator", "agent", "trainer"):
        for variable in services(compose)[name]["environment"]:
            assert f'"{variable}"' in source, f"{name}: torshmon never reads {variable}"


def test_compose_aggregator_reaches_postgres_and_alertmanager(compose: dict[str, Any]) -> None:
    svc = services(compose)
    env = svc["aggregator"]["environment"]
    db = urlsplit(env["TORSHMON_DB_URL"].replace("${POSTGRES_PASSWORD:-torshmon}", "pw"))
    assert db.scheme == "postgresql+psycopg"
    assert (db.hostname, db.port) == ("postgres", 5432)
    pg = svc["postgres"]["environment"]
    assert db.username == pg["POSTGRES_USER"] and db.path == "/" + pg["POSTGRES_DB"]
    query = urlsplit(
        env["TORSHMON_QUERY_DB_URL"].replace("${TORSHMON_READER_PASSWORD:-torshmon_reader}", "pw")
    )
    assert (query.scheme, query.hostname, query.port, query.path) == (
        db.scheme,
        db.hostname,
        db.port,
        db.path,
    )
    assert (query.username, query.password) == ("torshmon_reader", "pw")
    assert svc["aggregator"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    manager = urlsplit(env["TORSHMON_ALERTMANAGER_URL"])
    assert manager.netloc == f"alertmanager:{ALERTMANAGER_PORT}"
    args = torshmon_args(svc["alertmanager"])
    assert f"--web.listen-address=0.0.0.0:{ALERTMANAGER_PORT}" in args


def test_compose_trainer_and_agent_share_the_socket_and_processes(
    compose: dict[str, Any],
) -> None:
    svc = services(compose)
    socket = flag(torshmon_args(svc["agent"]), "--socket")
    assert svc["trainer"]["environment"]["TORSHMON_AGENT_SOCKET"] == socket
    directory = str(Path(socket).parent)
    assert mounts(svc["agent"])[directory] == mounts(svc["trainer"])[directory]
    assert svc["trainer"]["pid"] == "service:agent"
    assert svc["trainer"]["depends_on"]["agent"]["condition"] == "service_healthy"
    assert "healthz" in " ".join(svc["agent"]["healthcheck"]["test"])
    trainer = torshmon_args(svc["trainer"])
    assert svc["trainer"]["entrypoint"] == ["torchrun"]
    script = next(a for a in trainer if a.endswith(".py"))
    assert script == dockerfile_copies()["deploy/train.py"]
    train = load_module(DEPLOY / "train.py", "torshmon_deploy_train")
    script_args = trainer[trainer.index(script) + 1 :]
    old_argv = sys.argv
    sys.argv = ["train.py", *script_args]
    try:
        parsed = train.parse_args()
    finally:
        sys.argv = old_argv
    assert parsed.bucket_timing, "the collectives dashboard needs the DDP buckets timed"


def test_compose_prometheus_scrapes_the_services_on_their_ports(compose: dict[str, Any]) -> None:
    svc = services(compose)
    prom = svc["prometheus"]
    args = torshmon_args(prom)
    config_path = next(a.split("=", 1)[1] for a in args if a.startswith("--config.file="))
    assert mounts(prom)[config_path] == "./deploy/prometheus.yml"
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    for rule_file in config["rule_files"]:
        inside = str(Path(config_path).parent / rule_file)
        assert inside in mounts(prom), f"{rule_file} is not mounted beside the config"
        assert (ROOT / mounts(prom)[inside]).is_file()
    targets = {
        job["job_name"]: [t for c in job["static_configs"] for t in c["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets == {"torshmon-aggregator": ["aggregator:9470"], "torshmon-agent": ["agent:9465"]}
    for job in config["scrape_configs"]:
        # The training job's name is in the `job` label; Prometheus must not rename it.
        assert job["honor_labels"] is True
    assert "alerting" not in config, "the aggregator notifies; Prometheus would notify twice"


def test_compose_alertmanager_reads_the_slack_secret(compose: dict[str, Any]) -> None:
    am = services(compose)["alertmanager"]
    args = torshmon_args(am)
    config_path = next(a.split("=", 1)[1] for a in args if a.startswith("--config.file="))
    assert mounts(am)[config_path] == "./deploy/alertmanager.yml"
    config = yaml.safe_load((DEPLOY / "alertmanager.yml").read_text())
    secret_file = Path(config["global"]["slack_api_url_file"])
    assert secret_file.parent == Path("/run/secrets")
    assert secret_file.name in am["secrets"]
    assert compose["secrets"][secret_file.name] == {"environment": "TORSHMON_SLACK_WEBHOOK_URL"}


def test_compose_grafana_provisions_prometheus_and_the_dashboards(
    compose: dict[str, Any], build: ModuleType
) -> None:
    grafana = services(compose)["grafana"]
    volumes = mounts(grafana)
    assert volumes["/etc/grafana/provisioning"] == "./grafana/provisioning"
    sources = yaml.safe_load(
        (ROOT / "grafana" / "provisioning" / "datasources" / "torshmon.yml").read_text()
    )["datasources"]
    prometheus = next(s for s in sources if s["type"] == "prometheus")
    assert prometheus["uid"] == build.DATASOURCE_UID
    assert prometheus["url"] == f"http://prometheus:{PROMETHEUS_PORT}"
    prom_args = torshmon_args(services(compose)["prometheus"])
    assert f"--web.listen-address=0.0.0.0:{PROMETHEUS_PORT}" in prom_args
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["global"]
    assert prometheus["jsonData"]["timeInterval"] == scrape["scrape_interval"]
    manager = next(s for s in sources if s["type"] == "alertmanager")
    assert manager["url"] == f"http://alertmanager:{ALERTMANAGER_PORT}"
    (provider,) = yaml.safe_load(
        (ROOT / "grafana" / "provisioning" / "dashboards" / "torshmon.yml").read_text()
    )["providers"]
    dashboards_dir = provider["options"]["path"]
    assert volumes[dashboards_dir] == "./dashboards"
    home = Path(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert str(home.parent) == dashboards_dir and (ROOT / "dashboards" / home.name).is_file()


# -- agent/: image, systemd unit, Kubernetes -------------------------------------------------


def dockerfile_copies() -> dict[str, str]:
    """Source -> destination of every COPY (destinations relative to WORKDIR as written)."""
    copies = {}
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            *sources, destination = shlex.split(line)[1:]
            for source in sources:
                copies[source] = destination
    return copies


def test_dockerfile_copies_what_exists_and_runs_torshmon() -> None:
    copies = dockerfile_copies()
    for source in copies:
        assert (ROOT / source).exists(), f"agent/Dockerfile copies missing {source}"
    text = DOCKERFILE.read_text()
    assert 'ENTRYPOINT ["torshmon"]' in text
    cmd = json.loads(re.search(r"^CMD (.*)$", text, re.M)[1])  # type: ignore[index]
    assert build_parser().parse_args(cmd).command == "agent"
    assert re.search(r"^EXPOSE 9465 9470$", text, re.M)
    # The build context holds only what is copied (BuildKit's per-Dockerfile ignore file).
    ignore_file = (ROOT / "agent" / "Dockerfile.dockerignore").read_text()
    ignore = [line for line in ignore_file.splitlines() if line and not line.startswith("#")]
    assert ignore[0] == "*", "exclude everything, then list what the image copies"
    assert {f"!{source}" for source in copies} <= set(ignore)
    # The migrations ship inside the package: a plain (not editable) install has them.
    assert "alembic" not in copies and copies["torshmon"] == "./torshmon"
    assert "pip install -e" not in text  # the wheel: tests/test_image.py


def systemd_unit() -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in SYSTEMD_UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


def test_systemd_unit_runs_the_agent_with_consistent_paths() -> None:
    unit = systemd_unit()
    assert set(unit) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    (exec_start,) = service["ExecStart"]
    argv = shlex.split(exec_start)
    assert Path(argv[0]).name == "torshmon"
    args = build_parser().parse_args(
        [a.replace("${CREDENTIALS_DIRECTORY}", "/run/credentials/x") for a in argv[1:]]
    )
    assert args.command == "agent" and args.metrics_port == 9465
    assert Path(args.socket).parent == Path("/run") / service["RuntimeDirectory"][0]
    assert Path(args.spool).parent == Path("/var/lib") / service["StateDirectory"][0]
    # The agent refuses folders that others may write to; the group connects through
    # the socket's own group (0660), and trusts the agent's user by name.
    for mode in ("RuntimeDirectoryMode", "StateDirectoryMode"):
        assert int(service[mode][0], 8) & 0o022 == 0, mode
    assert [args.socket_group] == service["Group"] == service["User"]
    assert f"TORSHMON_AGENT_USER={service['User'][0]}" in SYSTEMD_UNIT.read_text()
    (credential,) = service["LoadCredential"]
    assert str(args.token_file) == "/run/credentials/x/" + credential.split(":")[0]
    environment = dict(e.split("=", 1) for e in service["Environment"])
    assert environment["TORSHMON_AGENT_SOCKET"] == args.socket
    assert service["KillSignal"] == ["SIGTERM"]  # the agent flushes its spool on SIGTERM
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_kubernetes_sidecar_shares_the_socket_with_torchrun() -> None:
    (job,) = list(yaml.safe_load_all(K8S.read_text()))
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    pod = job["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    (agent,) = pod["initContainers"]
    assert agent["restartPolicy"] == "Always", "a native sidecar (Kubernetes 1.29+)"
    (trainer,) = pod["containers"]
    args = build_parser().parse_args([a.replace("$(NODE_NAME)", "node-a") for a in agent["args"]])
    assert args.command == "agent"
    env_names = {e["name"] for e in agent["env"]}
    assert {"NODE_NAME", "TORSHMON_TOKEN"} <= env_names
    secret = next(e for e in agent["env"] if e["name"] == "TORSHMON_TOKEN")
    ref = secret["valueFrom"]["secretKeyRef"]
    assert f"kubectl create secret generic {ref['name']} --from-literal={ref['key']}=" in (
        K8S.read_text()
    )
    trainer_env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert trainer_env["TORSHMON_AGENT_SOCKET"] == args.socket
    agent_mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    trainer_mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
    # An emptyDir is 0777, which the agent refuses to keep its socket or spool in:
    # each goes into a folder of the agent's own inside its volume.
    socket_mount = str(Path(args.socket).parent.parent)
    assert agent_mounts[socket_mount] == trainer_mounts[socket_mount]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(agent_mounts.values()) | set(trainer_mounts.values()) <= set(volumes)
    spool_mount = str(Path(args.spool).parent.parent)
    assert spool_mount in agent_mounts
    for mount in (socket_mount, spool_mount):
        assert "emptyDir" in volumes[agent_mounts[mount]]
    (port,) = agent["ports"]
    assert port["containerPort"] == args.metrics_port == 9465
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(args.metrics_port)
    for probe in ("startupProbe", "livenessProbe"):
        assert agent[probe]["httpGet"]["port"] == port["name"]
        assert agent[probe]["httpGet"]["path"] == "/healthz"
    assert trainer["command"] == ["torchrun"]
    assert dockerfile_copies()["deploy/train.py"] in trainer["args"]


# -- docs -----------------------------------------------------------------------------------


def doc_commands() -> Iterator[tuple[str, list[str]]]:
    """``torshmon ...`` command lines in the docs' code blocks, as argv after ``torshmon``."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name == "tables.md":
            continue
        in_block = False
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                in_block = not in_block
                continue
            if not in_block:
                continue
            try:
                words = shlex.split(line.split(" #")[0], comments=False) if line.strip() else []
            except ValueError:
                # Not shell (a tree drawing, a continued curl line); a torshmon line must be.
                assert "torshmon " not in line.split("#")[0].lstrip()[:20], (page.name, line)
                continue
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                words = words[1:]  # VAR=value prefixes
            for index, word in enumerate(words):
                if word in (">", "|", "&&", "<"):
                    words = words[:index]  # the shell's, not torshmon's
                    break
            if words and words[0] in ("torshmon", ".venv/bin/torshmon"):
                yield page.name, words[1:]


def test_docs_pages_exist_and_their_torshmon_commands_parse() -> None:
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"prometheus-grafana.md", "slack.md", "postgresql.md", "otlp.md"} <= pages
    parser = build_parser()
    commands = list(doc_commands())
    assert len(commands) >= 5
    for page, argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page}: torshmon {' '.join(argv)} is not a valid command line")


def test_files_name_only_docs_that_exist() -> None:
    for path in (COMPOSE, SYSTEMD_UNIT, K8S, DOCKERFILE, DEPLOY / "prometheus.yml"):
        for doc in re.findall(r"docs/[\w.-]+\.md", path.read_text()):
            assert (ROOT / doc).is_file(), f"{path.name} names missing {doc}"

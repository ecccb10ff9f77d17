"""deploy/ checked against the code it runs, so the two cannot drift: every
Kubernetes manifest and systemd unit starts a real entry point with flags its
parser has, names only KVFS_* variables that are settings, builds a config the
real loader accepts, and agrees with itself on ports (Services, container ports,
probes, scrape annotations, the ServiceMonitor, the addresses servers are told).
The Dockerfile installs this package and runs its entry points, as the manifests
expect. The Grafana dashboard queries only metrics the servers define."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shlex
import tomllib

import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvfs.chunkserver.config import ChunkserverConfig
from kvfs.chunkserver.metrics import ChunkMetrics, StoreCollector
from kvfs.chunkserver.scrub import Scrubber
from kvfs.chunkserver.store import ChunkStore
from kvfs.client.config import ClientConfig
from kvfs.config import load
from kvfs.metaserver.config import MetaserverConfig
from kvfs.metaserver.metrics import RpcMetrics, StatusCollector
from kvfs.proto import meta_pb2
from kvfs.serving import flag_parser

from helpers import dashboard_queries

ROOT = pathlib.Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# entry point -> its settings and TOML table, as its main() hands them to run_server
SERVERS = {"kvfs-metaserver": (MetaserverConfig, "metaserver"),
           "kvfs-chunkserver": (ChunkserverConfig, "chunkserver")}
SECTIONS = {"metaserver": MetaserverConfig, "chunkserver": ChunkserverConfig, "client": ClientConfig}
SECRETS = ("tls_ca", "tls_cert", "tls_key", "cluster_key")
# what the downward API gives a pod, for one example pod
POD_FIELDS = {"metadata.namespace": "kvfs", "spec.nodeName": "node-a", "status.podIP": "10.0.0.7"}
ANY_HOST = ("0.0.0.0", "::", "[::]")


def port(address: str) -> int:
    return int(address.rpartition(":")[2])


def host(address: str) -> str:
    return address.rpartition(":")[0]


def check_env_names(env: dict[str, str], where: str) -> None:
    """Every KVFS_<PART>_<KEY> names a setting: the loader ignores others silently."""
    for name in env:
        if not name.startswith("KVFS_") or name == "KVFS_CONFIG":
            continue
        part, _, key = name[len("KVFS_"):].partition("_")
        cls = SECTIONS.get(part.lower())
        assert cls is not None, f"{where}: {name}: no part {part.lower()!r} (one of {', '.join(SECTIONS)})"
        assert key.lower() in {f.name for f in dataclasses.fields(cls)}, f"{where}: {name} is not a {part} setting"


def server_config(program: str, args: list[str], env: dict[str, str], where: str):
    """The config `program` would run with: its real parser, the real loader."""
    assert program in SCRIPTS, f"{where}: {program} is not an entry point of pyproject.toml"
    assert program in SERVERS, f"{where}: {program} is not a server"
    cls, section = SERVERS[program]
    assert SCRIPTS[program] == f"kvfs.{section}.main:main", f"{program} runs {SCRIPTS[program]}"
    parser = flag_parser(program, "", cls)
    flags = {s for action in parser._actions for s in action.option_strings}
    for arg in args:  # exactly: the parser would also take an unambiguous abbreviation
        if arg.startswith("--") and arg.split("=", 1)[0] not in flags:
            pytest.fail(f"{where}: {program} has no flag {arg.split('=', 1)[0]}")
    try:
        parsed = parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: {program} refuses its arguments {args}")
    check_env_names(env, where)
    try:
        return load(cls, section, vars(parsed), env)
    except (ValueError, OSError) as err:
        pytest.fail(f"{where}: {program}'s settings do not load: {err}")


def check_listens(cfg, where: str) -> None:
    """Fixed, distinct ports (a free one would be unknown to Services and scrapers),
    metrics on, and an advertised address where the server binds every interface."""
    listens = [cfg.listen, cfg.metrics_listen] + ([cfg.data_listen] if isinstance(cfg, ChunkserverConfig) else [])
    assert all(listens), f"{where}: listen, metrics_listen (and data_listen) must be set: {listens}"
    ports = [port(a) for a in listens]
    assert 0 not in ports and len(set(ports)) == len(ports), f"{where}: ports must be fixed and distinct: {listens}"
    if isinstance(cfg, ChunkserverConfig):
        assert cfg.meta, f"{where}: a chunkserver needs the metaserver's address"
        if host(cfg.listen) in ANY_HOST:
            assert cfg.advertise, f"{where}: listening on {cfg.listen}, it must advertise a reachable address"
        assert port(cfg.advertise or cfg.listen) == port(cfg.listen), f"{where}: advertises another port"
    if not cfg.insecure:
        assert all(getattr(cfg, f) for f in SECRETS), f"{where}: TLS files and cluster key needed"


# ---- Kubernetes ----------------------------------------------------------------

WORKLOADS = ("StatefulSet", "DaemonSet")
KINDS = ("ConfigMap", "Service", "ServiceMonitor", *WORKLOADS)


@dataclasses.dataclass
class Container:
    """A server container of a workload, with the config it would run with."""

    workload: dict
    spec: dict
    pod: str  # an example pod's name
    program: str = ""
    cfg: object = None

    @property
    def name(self) -> str:
        return f"{self.workload['metadata']['name']}/{self.spec['name']}"

    @property
    def ports(self) -> dict[str, int]:
        return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in self.spec.get("ports", [])}

    def resolve(self, target) -> int:
        """A port a Service or probe names (by name or number) as a container port."""
        if isinstance(target, int):
            assert target in self.ports.values(), f"{self.name}: no container port {target}"
            return target
        assert target in self.ports, f"{self.name}: no container port named {target!r}"
        return self.ports[target]

    def volume_of(self, path: str) -> tuple[str, dict, str]:
        """(kind, volume, path inside it) of the file or folder at `path`: kind is
        configMap, secret, claim (a volumeClaimTemplate), hostPath..."""
        mounts = [m for m in self.spec.get("volumeMounts", [])
                  if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounts, f"{self.name}: nothing is mounted at {path}"
        mount = max(mounts, key=lambda m: len(m["mountPath"]))
        inside = path[len(mount["mountPath"]):].lstrip("/")
        if mount["name"] in {t["metadata"]["name"] for t in self.workload["spec"].get("volumeClaimTemplates", [])}:
            return "claim", {"name": mount["name"]}, inside
        volumes = {v["name"]: v for v in self.workload["spec"]["template"]["spec"].get("volumes", [])}
        assert mount["name"] in volumes, f"{self.name}: mount of an unknown volume {mount['name']}"
        volume = volumes[mount["name"]]
        return next(k for k in volume if k != "name"), volume, inside

    def env(self) -> dict[str, str]:
        """Its environment in the example pod (the downward API's fields filled in)."""
        env = {}
        for e in self.spec.get("env", []):
            if "value" in e:
                env[e["name"]] = str(e["value"])
            else:
                field = e["valueFrom"]["fieldRef"]["fieldPath"]
                env[e["name"]] = self.pod if field == "metadata.name" else POD_FIELDS[field]
        return env


SEVERAL = DEPLOY / "kubernetes" / "several-metaservers"  # replaces the base metaserver.yaml


def kubernetes_docs(several: bool = False) -> list[dict]:
    """The manifests: the base set (one metaserver), or with `several` the base set
    with several-metaservers/metaserver.yaml in place of metaserver.yaml."""
    files = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
    if several:
        files = [SEVERAL / f.name if (SEVERAL / f.name).exists() else f for f in files]
        assert any(f.parent == SEVERAL for f in files), "nothing in several-metaservers/ replaces a base manifest"
    docs = [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]
    assert docs, "no manifests in deploy/kubernetes"
    for d in docs:
        assert d.get("kind") in KINDS, f"{d.get('kind')} {d['metadata']['name']}: add a check for this kind"
    return docs


def selects(service: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def server_container(c: Container, configmaps: dict[str, dict], tmp_path: pathlib.Path) -> Container:
    """`c` with its program and the config it would load: $(VAR)s expanded as the
    kubelet does, its TOML file taken from the ConfigMap mounted where it points."""
    env = c.env()

    def expand(m: re.Match) -> str:  # an undefined $(VAR) would reach the server literally
        assert m.group(1) in env, f"{c.name}: $({m.group(1)}) is not defined"
        return env[m.group(1)]

    def local_copy(path: str) -> str:
        kind, volume, inside = c.volume_of(path)
        assert kind == "configMap", f"{c.name}: {path} must come from a ConfigMap, not {kind}"
        data = configmaps[volume["configMap"]["name"]]["data"]
        assert inside in data, f"{c.name}: ConfigMap {volume['configMap']['name']} has no {inside}"
        copy = tmp_path / f"{volume['configMap']['name']}-{inside}"
        copy.write_text(data[inside])
        return str(copy)

    program, *args = c.spec["command"] + c.spec.get("args", [])
    args = [re.sub(r"\$\((\w+)\)", expand, a) for a in args]
    args = [f"--config={local_copy(a.split('=', 1)[1])}" if a.startswith("--config=") else a for a in args]
    if "KVFS_CONFIG" in env:
        env["KVFS_CONFIG"] = local_copy(env["KVFS_CONFIG"])
    return dataclasses.replace(c, program=program, cfg=server_config(program, args, env, c.name))


@pytest.fixture(params=["one metaserver", "several metaservers"])
def kube(request, tmp_path) -> tuple[list[dict], list[Container]]:
    """Every manifest, and each workload's containers with the config they would load;
    once with the base set, once with several metaservers."""
    docs = kubernetes_docs(several=request.param == "several metaservers")
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    containers = [server_container(Container(w, spec, f"{w['metadata']['name']}-0"), configmaps, tmp_path)
                  for w in docs if w["kind"] in WORKLOADS for spec in w["spec"]["template"]["spec"]["containers"]]
    return docs, containers


def test_every_kubernetes_container_runs_a_server_with_real_flags_variables_and_files(kube):
    docs, containers = kube
    assert sorted(c.program for c in containers) == sorted(SERVERS), "one workload per server"
    for c in containers:
        check_listens(c.cfg, c.name)
        for field in SECRETS:
            kind = c.volume_of(getattr(c.cfg, field))[0]
            assert kind == "secret", f"{c.name}: {field} must come from a Secret, not {kind}"
        assert c.volume_of(c.cfg.data_dir)[0] in ("claim", "hostPath"), f"{c.name}: data_dir must persist"
        # every port the server binds is a container port, and nothing else is
        binds = [c.cfg.listen, c.cfg.metrics_listen] + ([c.cfg.data_listen] if c.program == "kvfs-chunkserver"
                                                         else [])
        assert sorted(c.ports.values()) == sorted(port(a) for a in binds), c.name
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = c.spec.get(kind)
            if probe:
                check = probe.get("tcpSocket") or probe.get("grpc")
                assert check, f"{c.name}: {kind}: a tcpSocket or grpc probe of the gRPC port"
                assert c.resolve(check["port"]) == port(c.cfg.listen), f"{c.name}: {kind} probes another port"
        annotations = c.workload["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", c.name
        assert annotations.get("prometheus.io/port") == str(port(c.cfg.metrics_listen)), c.name


def test_kubernetes_services_expose_the_ports_the_servers_bind_and_tell_each_other(kube):
    docs, containers = kube
    services = [d for d in docs if d["kind"] == "Service"]
    by_workload = {c.workload["metadata"]["name"]: c for c in containers}
    exposed = {name: set() for name in by_workload}
    for s in services:
        selected = [c for c in containers if selects(s, c.workload)]
        assert len(selected) == 1, f"Service {s['metadata']['name']} selects {len(selected)} workloads"
        c = selected[0]
        for p in s["spec"]["ports"]:
            target = c.resolve(p.get("targetPort", p["port"]))
            # headless Services hand out pod addresses: the port clients use is the container's
            assert p["port"] == target, f"Service {s['metadata']['name']}: port {p['port']} -> {target}"
            exposed[c.workload["metadata"]["name"]].add(target)
    for name, c in by_workload.items():
        assert exposed[name] == set(c.ports.values()), f"{name}: ports without a Service: {c.ports}"
        governing = c.workload["spec"].get("serviceName")
        if governing:
            assert any(s["metadata"]["name"] == governing and selects(s, c.workload) for s in services), name
    meta = next(c for c in containers if c.program == "kvfs-metaserver")
    for c in containers:
        if c.program != "kvfs-chunkserver":
            continue
        # the metaserver's address: a Service selecting it, on the port it listens on
        service = next((s for s in services if s["metadata"]["name"] == host(c.cfg.meta)), None)
        assert service is not None and selects(service, meta.workload), f"{c.name}: meta {c.cfg.meta}"
        assert port(c.cfg.meta) == port(meta.cfg.listen), f"{c.name}: meta {c.cfg.meta}"
        # each pod is its own server: its id, its certificate, its stable DNS name
        assert c.cfg.id == c.pod, c.name
        assert pathlib.PurePath(c.cfg.tls_cert).stem == c.cfg.id, f"{c.name}: a certificate naming its id"
        governing = c.workload["spec"]["serviceName"]
        assert host(c.cfg.advertise) == f"{c.pod}.{governing}.{POD_FIELDS['metadata.namespace']}.svc", c.name


def test_the_servicemonitor_scrapes_every_servers_metrics_port(kube):
    docs, containers = kube
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    wanted = monitor["spec"]["selector"]["matchLabels"]
    services = [d for d in docs if d["kind"] == "Service"
                and all(d["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())]
    for c in containers:  # every server is scraped on the port it serves metrics on, at /metrics
        scraped = set()
        for s in (s for s in services if selects(s, c.workload)):
            ports = {p.get("name"): p for p in s["spec"]["ports"]}
            for endpoint in monitor["spec"]["endpoints"]:
                assert endpoint["port"] in ports, f"Service {s['metadata']['name']}: no port {endpoint['port']}"
                assert endpoint.get("path", "/metrics") == "/metrics"
                p = ports[endpoint["port"]]
                scraped.add(c.resolve(p.get("targetPort", p["port"])))
        assert scraped == {port(c.cfg.metrics_listen)}, f"{c.name}: scraped on {scraped}"


def dockerfile() -> list[tuple[str, str]]:
    """deploy/Dockerfile as (INSTRUCTION, arguments), continuation lines joined."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_the_dockerfile_installs_this_package_without_extras_and_runs_its_servers(kube):
    docs, containers = kube
    steps = dockerfile()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert steps[0] == ("FROM", "python:3.11-slim")
    floor = re.search(r"(\d+)\.(\d+)", project["project"]["requires-python"]).groups()
    assert (3, 11) >= tuple(map(int, floor)), "the image's Python is older than requires-python"
    copied = {pathlib.PurePath(src).as_posix().rstrip("/") for kind, args in steps if kind == "COPY"
              for src in shlex.split(args)[:-1]}
    folders = {pathlib.PurePath(d).parts[0] for d in project["tool"]["setuptools"]["package-dir"].values()}
    assert folders | {"pyproject.toml", project["project"]["readme"]} <= copied, "a package folder is not copied"
    installs = [shlex.split(args) for kind, args in steps if kind == "RUN" and "pip install" in args]
    assert len(installs) == 1
    targets = [a for a in installs[0][installs[0].index("install") + 1:] if not a.startswith("-")][:1]
    assert targets == ["."], f"pip installs {targets}, not the package itself without extras"
    (cmd,) = [json.loads(args) for kind, args in steps if kind == "CMD"]
    assert cmd[0] in SERVERS and cmd[0] in SCRIPTS, f"CMD runs {cmd[0]}, not a server's entry point"
    # what the manifests run on it: their programs, user, ports and the image's version
    assert {c.program for c in containers} <= set(SCRIPTS)
    (user,) = [args for kind, args in steps if kind == "USER"]
    for c in containers:
        context = c.workload["spec"]["template"]["spec"].get("securityContext", {})
        assert str(context.get("runAsUser")) == user, f"{c.name} runs as {context.get('runAsUser')}, image as {user}"
        assert c.spec["image"].rpartition(":")[2] == project["project"]["version"], c.name
    exposed = {int(p) for kind, args in steps if kind == "EXPOSE" for p in args.split()}
    assert exposed == {p for c in containers for p in c.ports.values()}, "EXPOSE is not the servers' ports"


def test_several_metaservers_on_kubernetes_each_join_etcd_as_their_pod_over_tls(tmp_path):
    docs = kubernetes_docs(several=True)
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    (workload,) = [d for d in docs if d["kind"] in WORKLOADS and d["metadata"]["name"] == "kvfs-metaserver"]
    replicas = workload["spec"]["replicas"]
    assert replicas >= 2
    for i in range(replicas):  # each pod as the shard map will list it
        (spec,) = workload["spec"]["template"]["spec"]["containers"]
        c = server_container(Container(workload, spec, f"kvfs-metaserver-{i}"), configmaps, tmp_path)
        cfg = c.cfg
        assert cfg.metaserver_id == c.pod and cfg.expect_metaservers == replicas and not cfg.insecure
        governing = workload["spec"]["serviceName"]
        assert cfg.advertise == f"{c.pod}.{governing}.{POD_FIELDS['metadata.namespace']}.svc:{port(cfg.listen)}"
        assert len(cfg.etcd.split(",")) >= 3, "etcd runs three or five members"
        for field in ("etcd_ca", "etcd_cert", "etcd_key"):  # TLS to etcd, from a Secret of its own
            kind, volume, _ = c.volume_of(getattr(cfg, field))
            assert kind == "secret" and volume["secret"]["secretName"] != "kvfs-metaserver-tls", field
    # the chunkservers and workers need one address: the rest come from heartbeat replies and the shard map
    chunk = next(d for d in docs if d["kind"] in WORKLOADS and d["metadata"]["name"] == "kvfs-chunkserver")
    (chunk_spec,) = chunk["spec"]["template"]["spec"]["containers"]
    chunk_cfg = server_container(Container(chunk, chunk_spec, "kvfs-chunkserver-0"), configmaps, tmp_path).cfg
    assert host(chunk_cfg.meta) == workload["spec"]["serviceName"]


def test_kubernetes_configmap_files_load_with_the_real_loader(tmp_path):
    found = 0
    for d in kubernetes_docs():
        if d["kind"] != "ConfigMap":
            continue
        for key, text in d["data"].items():
            assert key.endswith(".toml"), f"ConfigMap {d['metadata']['name']}: {key}"
            path = tmp_path / key
            path.write_text(text)
            sections = tomllib.loads(text)
            assert set(sections) <= set(SECTIONS), f"{key}: unknown tables {set(sections) - set(SECTIONS)}"
            for section in sections:
                load(SECTIONS[section], section, {"config": str(path)}, env={})
                found += 1
    assert found >= 2


# ---- systemd -------------------------------------------------------------------

INSTANCE = "cs-1"  # the example instance of template units (deploy/systemd/cs-1.env)


def unit_sections(text: str, where: str) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit: section -> (key, value) in order (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{where}: not key=value: {line}"
        current.append((key.strip(), value.strip()))
    return sections


def env_file(path: pathlib.Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=value: {line}"
            env[key] = value
    return env


@dataclasses.dataclass
class Unit:
    name: str  # a template's with the example instance: kvfs-chunkserver@cs-1.service
    service: dict[str, str]  # [Service], the last value of each key
    program: str
    cfg: object


def systemd_units() -> list[Unit]:
    """Every unit of deploy/systemd with the config it would run with: ExecStart's
    flags over its EnvironmentFiles (the shipped ones of the same name)."""
    units = []
    for path in sorted((DEPLOY / "systemd").glob("*.service")):
        name, text = path.name, path.read_text()
        if name.endswith("@.service"):
            name, text = name.replace("@", f"@{INSTANCE}"), text.replace("%i", INSTANCE)
        sections = unit_sections(text, name)
        assert {"Unit", "Service", "Install"} <= set(sections), name
        service = sections["Service"]
        starts = [v for k, v in service if k == "ExecStart"]
        assert len(starts) == 1, f"{name}: one ExecStart"
        program, *args = shlex.split(starts[0].lstrip("-@+!:"))
        env: dict[str, str] = {}
        for key, value in service:
            if key == "Environment":
                env.update(item.split("=", 1) for item in shlex.split(value))
            elif key == "EnvironmentFile":
                shipped = DEPLOY / "systemd" / pathlib.PurePath(value.lstrip("-")).name
                assert shipped.exists(), f"{name}: {value}: no {shipped.name} in deploy/systemd"
                env.update(env_file(shipped))
        program = pathlib.PurePath(program).name
        units.append(Unit(name, dict(service), program, server_config(program, args, env, name)))
    return units


def test_every_systemd_unit_runs_a_server_with_real_flags_variables_and_settings():
    units = {u.program: u for u in systemd_units()}
    assert sorted(units) == sorted(SERVERS), "a unit per server"
    for u in units.values():
        check_listens(u.cfg, u.name)
        assert u.service.get("Restart") == "on-failure", u.name
    meta, chunk = units["kvfs-metaserver"].cfg, units["kvfs-chunkserver"].cfg
    # systemd makes and owns the metaserver's data folder
    assert meta.data_dir == "/var/lib/" + units["kvfs-metaserver"].service["StateDirectory"]
    # the instance name is the chunkserver's id, and names its certificate
    assert chunk.id == INSTANCE and pathlib.PurePath(chunk.tls_cert).stem == INSTANCE
    assert port(chunk.meta) == port(meta.listen), "the chunkservers' meta is the metaserver's port"
    for env in (DEPLOY / "systemd").glob("*.env"):  # none shipped that no unit reads
        assert env.name in {"metaserver.env", "chunkserver.env", f"{INSTANCE}.env"}, env.name


# ---- the Grafana dashboard -----------------------------------------------------


def metric_names(registry: CollectorRegistry) -> set[str]:
    """The series names a scrape of `registry` can hold, also of families with no
    sample yet (a labelled metric before its first label)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    names = set()
    for family in registry.collect():
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    return names


def test_the_dashboard_queries_only_metrics_the_servers_define(make_state, tmp_path, event_loop_thread):
    registry = CollectorRegistry()
    RpcMetrics(registry)
    registry.register(StatusCollector(make_state().blocks, meta_pb2.StatusReply, event_loop_thread))
    ChunkMetrics(registry)
    store = ChunkStore(ChunkserverConfig(data_dir=str(tmp_path / "cs"), capacity=1 << 30, io_mode="buffered"))
    try:
        registry.register(StoreCollector(store, Scrubber(store, 0, 3600, remove=True), None))
        defined = metric_names(registry)
    finally:
        store.close()
    queries = dashboard_queries(DEPLOY / "grafana" / "kvfs.json")
    assert len(queries) >= 10
    for title, expr in queries:
        used = set(re.findall(r"\bkvfs_[a-z0-9_]+", expr))
        assert used, f"{title}: {expr} queries no kvfs metric"
        assert used <= defined, f"{title}: no such metric: {', '.join(sorted(used - defined))}"

"""docker-compose.yml, deploy/Dockerfile and deploy/k8s agree with the code.

Commands are real ``pdstate`` subcommands (parsed by the CLI's own argparse), config paths exist
in the image (mapped back to the repository), every ``--set`` and ``PDSTATE_*`` key is a real
config key (``load_config`` is strict), ports equal the ones in ``services/*/config.toml``, probe
paths are routes of the FastAPI app, and the decode dials the prefill where it listens.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from pdstate.cli import build_parser
from pdstate.settings.config import load_config
from pdstate.status.api import create_app, route_paths
from pdstate.worker.options import WorkerOptions
from tests.support.paths import REPO

K8S = REPO / "deploy" / "k8s"
ROLES = ("prefill", "decode")


def parser() -> argparse.ArgumentParser:
    return build_parser()


def parse(argv: list[str]) -> argparse.Namespace:
    try:
        return parser().parse_args([str(a) for a in argv])
    except SystemExit as exc:  # argparse exits on an unknown command or flag
        raise AssertionError(f"not a valid pdstate command line: {argv}") from exc


@pytest.fixture(scope="module")
def routes() -> set[str]:
    return route_paths(create_app(source=None))  # routes are static: the source is read per request


def service_config(role: str):
    return load_config(REPO / "services" / role / "config.toml", environ={})


def port_of(endpoint: str) -> tuple[str, int]:
    u = urlparse(endpoint)
    return u.hostname, u.port


# --- docker ------------------------------------------------------------------------------------


def dockerfile() -> str:
    return (REPO / "deploy" / "Dockerfile").read_text()


def image_path_to_repo(path: str) -> Path:
    """Map a path inside the image back to the repository via the Dockerfile's WORKDIR/COPY."""
    text = dockerfile()
    workdir = re.findall(r"^WORKDIR\s+(\S+)", text, re.M)[-1].rstrip("/")
    for src, dst in re.findall(r"^COPY\s+(\S+)\s+(\S+)\s*$", text, re.M):
        dst_abs = dst if dst.startswith("/") else f"{workdir}/{dst.lstrip('./')}"
        dst_abs = dst_abs.rstrip("/")
        if path.startswith(dst_abs + "/"):
            return REPO / src / path[len(dst_abs) + 1 :]
    raise AssertionError(f"{path} is not copied into the image by deploy/Dockerfile")


def test_dockerfile():
    text = dockerfile()
    assert text.startswith("#") and re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert "libibverbs1" in text and "librdmacm1" in text
    assert re.search(r"pip install torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cpu", text)
    assert '".[mooncake]"' in text
    assert re.search(r'^ENTRYPOINT \["pdstate"\]$', text, re.M)
    assert "torch==2.13.0" in (REPO / "tools" / "constraints-dev.txt").read_text()  # the pin the image repeats
    for src in re.findall(r"^COPY\s+(\S+)\s+\S+", text, re.M):
        assert (REPO / src).exists(), src
    assert (REPO / "deploy" / "Dockerfile.dockerignore").exists()


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def compose_config(svc: dict, env_extra: dict | None = None):
    args = parse(svc["command"])
    assert args.command == "serve"
    env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
    # compose interpolation: ${VAR:-default} -> default
    env = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", v) for k, v in env.items()}
    env = {k: v for k, v in env.items() if v != ""}
    env.update(env_extra or {})
    overrides = list(args.set)
    token_file = next((o.split("=", 1)[1] for o in overrides if o.startswith("auth.token_file=")), None)
    if token_file:  # a file of a mounted volume (tests/security/test_deploy_secrets.py checks which)
        assert any(v.split(":")[1] == token_file.rsplit("/", 1)[0] for v in svc.get("volumes", [])), token_file
        local = Path(tempfile.mkdtemp()) / "token"
        local.write_text("a-local-test-token-0123")
        local.chmod(0o600)
        overrides = [o if o != f"auth.token_file={token_file}" else f"auth.token_file={local}" for o in overrides]
    return args, load_config(image_path_to_repo(args.config), overrides, environ=env)


def test_compose_services(compose, routes):
    services = compose["services"]
    assert set(services) == {*ROLES, "secret"}  # secret: the one-shot token generator
    cfgs = {}
    for role in ROLES:
        svc = services[role]
        assert (
            svc["build"]["dockerfile"] == "deploy/Dockerfile"
            and (REPO / svc["build"]["context"] / "deploy/Dockerfile").exists()
        )
        args, cfg = compose_config(svc)
        cfgs[role] = cfg
        assert image_path_to_repo(args.config) == REPO / "services" / role / "config.toml"
        assert cfg.role == role
        base = service_config(role)
        assert cfg.http.port == base.http.port and cfg.http.host == "0.0.0.0"
        assert [f"127.0.0.1:{cfg.http.port}:{cfg.http.port}"] == svc["ports"]
        # healthcheck: GET /readyz on the configured port
        test = " ".join(svc["healthcheck"]["test"])
        m = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", test)
        assert m and int(m.group(1)) == cfg.http.port and m.group(2) == "/readyz" and m.group(2) in routes
        assert cfg.transfer.engine == "shm"  # ${PDSTATE_ENGINE:-shm}
        assert cfg.transfer.mooncake.host == f"{role}-data"  # each engine: its name on the data plane
    # the decode dials the prefill's control port by its data-plane name, once the prefill is healthy
    host, port = port_of(cfgs["decode"].control.peer)
    assert cfgs["prefill"].control.advertise == [f"tcp://prefill-data:{port}"] == [cfgs["decode"].control.peer]
    assert (
        host == "prefill-data"
        and port == port_of(cfgs["prefill"].control.bind)[1] == port_of(service_config("prefill").control.bind)[1]
    )
    assert str(port) in [str(p) for p in services["prefill"]["expose"]]
    assert services["decode"]["depends_on"]["prefill"] == {"condition": "service_healthy"}
    # shm: one IPC namespace and /dev/shm for both
    assert services["prefill"]["ipc"] == "shareable" and services["prefill"]["shm_size"]
    assert services["decode"]["ipc"] == "service:prefill"


def test_compose_mooncake_switch(compose):
    for role in ROLES:
        _, cfg = compose_config(compose["services"][role], {"PDSTATE_TRANSFER__ENGINE": "mooncake"})
        assert cfg.transfer.engine == "mooncake"
        assert WorkerOptions.from_config(cfg).engine_options == {
            "host": f"{role}-data",
            "protocol": "tcp",
            "device_name": "",
        }
    text = (REPO / "docker-compose.yml").read_text()
    assert "PDSTATE_ENGINE=mooncake" in text and "--set transfer.engine=mooncake" in text


def test_compose_data_plane_is_an_internal_network(compose):
    """Control and engine ports travel on ``dataplane`` (internal: no route out, nothing
    published), the names each worker is dialled by are its aliases there; only the HTTP port is
    published, from ``edge``; the one-shot token writer has no network at all."""
    nets = compose["networks"]
    assert nets["dataplane"] == {"internal": True} and not (nets["edge"] or {}).get("internal")
    services = compose["services"]
    for role in ROLES:
        svc = services[role]
        assert set(svc["networks"]) == {"dataplane", "edge"}
        assert svc["networks"]["dataplane"]["aliases"] == [f"{role}-data"]
        _, cfg = compose_config(svc, {"PDSTATE_TRANSFER__ENGINE": "mooncake"})
        assert WorkerOptions.from_config(cfg).engine_options["host"] == f"{role}-data"
        assert svc["ports"] == [f"127.0.0.1:{cfg.http.port}:{cfg.http.port}"]  # HTTP alone, host loopback
        if role == "decode":
            assert port_of(cfg.control.peer)[0] == "prefill-data"
    assert services["secret"]["network_mode"] == "none"
    used = {n for role in ROLES for n in services[role]["networks"]}
    assert used == set(nets)


# --- kubernetes --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[(doc["kind"], doc["metadata"]["name"]) if "metadata" in doc else (doc["kind"], path.name)] = doc
    return docs


def test_kustomization_lists_every_manifest(k8s):
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def test_configmap_carries_the_service_configs_verbatim(k8s):
    data = k8s[("ConfigMap", "pdstate-config")]["data"]
    for role in ROLES:
        assert data[f"{role}.toml"] == (REPO / "services" / role / "config.toml").read_text(), (
            f"deploy/k8s/configmap.yaml {role}.toml drifted from services/{role}/config.toml: "
            "run python deploy/sync_configmap.py"
        )


def _container(k8s, role):
    dep = k8s[("Deployment", f"pdstate-{role}")]
    assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return dep, pod, c


def k8s_config(k8s, role, tmp_path):
    dep, pod, c = _container(k8s, role)
    assert "command" not in c  # the image's ENTRYPOINT is pdstate
    args = parse(c["args"])
    assert args.command == "serve"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in c["volumeMounts"] if args.config.startswith(m["mountPath"].rstrip("/") + "/"))
    cm_name = volumes[mount["name"]]["configMap"]["name"]
    key = args.config[len(mount["mountPath"].rstrip("/")) + 1 :]
    path = tmp_path / f"{role}.toml"
    path.write_text(k8s[("ConfigMap", cm_name)]["data"][key])
    env = {}
    for e in c.get("env", []):
        assert e["name"].startswith("PDSTATE_")
        env[e["name"]] = e.get("value", "10.1.2.3" if "podIP" in str(e.get("valueFrom")) else "pod-name")
    overrides = list(args.set)
    token_file = next((o.split("=", 1)[1] for o in overrides if o.startswith("auth.token_file=")), None)
    if token_file:  # resolve it to a Secret mount, then point it at a local file for load_config
        m = next(m for m in c["volumeMounts"] if token_file.startswith(m["mountPath"].rstrip("/") + "/"))
        secret_name = volumes[m["name"]]["secret"]["secretName"]
        secret_key = token_file[len(m["mountPath"].rstrip("/")) + 1 :]
        kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
        (gen,) = [g for g in kust.get("secretGenerator", []) if g["name"] == secret_name]  # no Secret manifest
        assert secret_key in [f.split("=", 1)[0] for f in gen["files"]]
        local = tmp_path / f"{role}-token"
        local.write_text("a-local-test-token-0123")
        local.chmod(0o600)
        overrides = [o if not o.startswith("auth.token_file=") else f"auth.token_file={local}" for o in overrides]
    return dep, pod, c, load_config(path, overrides, environ=env), token_file


def test_k8s_deployments(k8s, routes, tmp_path):
    cfgs = {}
    for role in ROLES:
        dep, pod, c, cfg, token_file = k8s_config(k8s, role, tmp_path)
        cfgs[role] = cfg
        assert cfg.role == role and token_file and cfg.auth.secret() == b"a-local-test-token-0123"
        assert cfg.transfer.engine == "mooncake" and cfg.transfer.mooncake.host == "10.1.2.3"
        assert cfg.http.host == "0.0.0.0" and cfg.http.port == service_config(role).http.port
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == cfg.http.port
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
            get = c[probe]["httpGet"]
            assert get["path"] == path and get["path"] in routes
            assert ports.get(get["port"], get["port"]) == cfg.http.port
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
        # the Service routes to the real ports
        svc = k8s[("Service", f"pdstate-{role}")]
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        for sp in svc["spec"]["ports"]:
            target = sp["targetPort"]
            assert (target in ports) if isinstance(target, str) else (target in ports.values())
            if sp["name"] == "http":
                assert sp["port"] == cfg.http.port
        if role == "prefill":
            assert ports["control"] == port_of(cfg.control.bind)[1] == port_of(service_config(role).control.bind)[1]
    # the decode dials the prefill Service's control port
    host, port = port_of(cfgs["decode"].control.peer)
    svc = k8s[("Service", "pdstate-prefill")]
    assert host == svc["metadata"]["name"]
    sp = next(p for p in svc["spec"]["ports"] if p["port"] == port)
    _, _, pc = _container(k8s, "prefill")
    assert {p["name"]: p["containerPort"] for p in pc["ports"]}[sp["targetPort"]] == port_of(
        cfgs["prefill"].control.bind
    )[1]
    assert cfgs["prefill"].transfer.engine == cfgs["decode"].transfer.engine
    assert cfgs["prefill"].pool_settings() == cfgs["decode"].pool_settings()
    # a wildcard bind: the prefill takes shm proofs given to exactly the names it advertises
    assert port_of(cfgs["prefill"].control.bind)[0] == "0.0.0.0"
    assert cfgs["decode"].control.peer in cfgs["prefill"].control.advertise

"""deploy/sglang (an SGLang prefill/decode pair with backend pdstate) agrees with the code.

No GPU cluster is at hand, so the files are rendered and checked here: the image is SGLang's
release image (a tag that exists) plus pdstate installed from this repository; each server's launch
line is read by SGLang 0.5.19's own argument parser and the pair is compatible (``pdstate check
--sglang --strict``); each server's pdstate environment loads as backend pdstate's settings
(``load_settings``), with the rank endpoints on ``http.port + rank`` for every one of its TP ranks;
the probes, published ports, Prometheus targets, PodMonitor endpoints and NetworkPolicy name
exactly those ports and routes the app serves; the Kubernetes documents are checked against the
shape of their kinds (names, labels and selectors, port names, references between them).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from pdstate.errors import ExitCode
from pdstate.integrations.sglang.endpoint import rank_number
from pdstate.integrations.sglang.launch.command import parse_argv
from pdstate.integrations.sglang.registry import SUPPORTED_RELEASES
from pdstate.integrations.sglang.settings import load_settings
from pdstate.service.preflight import check_sglang
from pdstate.status.api import create_app, route_paths
from tests.support.paths import REPO

DEPLOY = REPO / "deploy" / "sglang"
K8S = DEPLOY / "k8s"
ROLES = ("prefill", "decode")
# SGLang's release images named anywhere in deploy/sglang, each seen published: v0.5.19 in SGLang's
# users' pinned deployments (e.g. Dynamo's SGLang examples: "They use lmsysorg/sglang:v0.5.19"),
# v0.5.19-cu129 in SGLang's install guide ("the last CUDA 12 tag").
PUBLISHED = {"lmsysorg/sglang:v0.5.19": "0.5.19", "lmsysorg/sglang:v0.5.19-cu129": "0.5.19"}
TOKEN = "a-local-test-token-0123"
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # DNS-1123 label
PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # IANA service name, 15 at most


@pytest.fixture(scope="module")
def routes() -> set[str]:
    return route_paths(create_app(source=None))


def _launch(argv: list[str]) -> dict:
    """A server's launch line as SGLang 0.5.19's own argument parser reads it: its TP size, mode,
    backend and ports."""
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"], argv
    parsed = parse_argv(argv[3:], "0.5.19")
    assert not parsed.error and not parsed.unknown, (parsed.error, parsed.unknown)
    v = parsed.values
    return {
        "tp": int(v["tp_size"]),
        "mode": v["disaggregation_mode"],
        "backend": v["disaggregation_transfer_backend"],
        "port": int(v["port"]),
        "bootstrap": int(v.get("disaggregation_bootstrap_port", 8998)),  # SGLang 0.5.19's default
    }


def _settings(role: str, env: dict[str, str], tmp_path: Path):
    """Backend pdstate's settings from a server's environment (its token file made here)."""
    token = tmp_path / f"{role}-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    env = {k: v for k, v in env.items() if k.startswith("PDSTATE_")}
    assert env["PDSTATE_AUTH__TOKEN_FILE"].startswith("/")
    return load_settings(role, {**env, "PDSTATE_AUTH__TOKEN_FILE": str(token)})


def _ports_in(script: str) -> list[int]:
    (m,) = re.findall(r"range\((\d+), (\d+)\)", script)
    return list(range(int(m[0]), int(m[1])))


def test_rank_numbering():
    assert [rank_number(t, 4) for t in range(4)] == [0, 1, 2, 3]
    assert rank_number(tp_rank=1, tp_size=4, pp_rank=1, pp_size=2) == 5
    assert rank_number(tp_rank=3, tp_size=4, pp_rank=1, pp_size=2, dp_rank=1) == 15
    every = {rank_number(t, 4, p, 2, d) for t in range(4) for p in range(2) for d in range(3)}
    assert every == set(range(24))  # one port each, no gaps


def test_dockerfile_is_sglangs_release_image_plus_pdstate():
    text = (DEPLOY / "Dockerfile").read_text()
    (image,) = re.findall(r"^ARG SGLANG_IMAGE=(\S+)$", text, re.M)
    assert PUBLISHED[image] in SUPPORTED_RELEASES
    assert re.search(r"^FROM \$\{SGLANG_IMAGE\}$", text, re.M)
    named = set(re.findall(r"lmsysorg/sglang:[\w.-]+", text))
    for path in [*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml"), REPO / "docs" / "operations.md"]:
        named |= set(re.findall(r"lmsysorg/sglang:[\w.-]+", path.read_text()))
    assert named <= set(PUBLISHED), named - set(PUBLISHED)
    assert re.search(r'^RUN pip install "\.\[sglang\]"', text, re.M)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r"^sglang = \[\]$", pyproject, re.M) and '"torch>=2.13",' in pyproject
    # torch is a range that both releases' own torch satisfies: installing pdstate changes no torch
    # in its image (tests/unit/test_install_plan.py asks pip's resolver)
    assert image.endswith("v0.5.19")
    for src in re.findall(r"^COPY\s+(\S+)\s+\S+", text, re.M):
        assert (REPO / src).exists(), src
    assert (DEPLOY / "Dockerfile.dockerignore").exists()


# --- docker compose ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _compose_env(svc: dict) -> dict[str, str]:
    env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", v) for k, v in env.items()}


def test_compose_launch_lines_are_a_compatible_pair(compose, capsys):
    lines = [shlex.join(compose["services"][role]["command"]) for role in ROLES]
    assert check_sglang(*lines, [], strict=True, timeout_s=5, releases=["0.5.19"]) == ExitCode.OK
    assert capsys.readouterr().out.rstrip().endswith("compatible")


def test_compose_ranks_endpoints(compose, routes, tmp_path):
    services = compose["services"]
    assert set(services) == {*ROLES, "secret", "router"}
    launches = {}
    for role in ROLES:
        svc = services[role]
        assert svc["build"] == {"context": "../..", "dockerfile": "deploy/sglang/Dockerfile"}
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve().exists()
        launch = launches[role] = _launch(svc["command"])
        assert launch["mode"] == role and launch["backend"] == "pdstate"
        s = _settings(role, _compose_env(svc), tmp_path)
        assert s.engine == "mooncake" and s.token == TOKEN.encode() and s.http_host == "0.0.0.0"
        ranks = [s.http_port + rank_number(t, launch["tp"]) for t in range(launch["tp"])]
        lo, hi = ranks[0], ranks[-1]
        assert svc["ports"] == [f"127.0.0.1:{lo}-{hi}:{lo}-{hi}"]
        script = svc["healthcheck"]["test"][-1]
        assert _ports_in(script) == ranks
        paths = re.findall(r"\{port\}(/\w+)", script)
        assert paths == ["/readyz" if role == "prefill" else "/healthz"] and paths[0] in routes
        assert f"http://127.0.0.1:{launch['port']}/health" in script  # SGLang's own
        assert "auth:/run/pdstate:ro" in svc["volumes"]
        assert len(svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]) == launch["tp"]
    devices = [services[r]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for r in ROLES]
    assert not set(devices[0]) & set(devices[1])  # GPUs of their own
    router = services["router"]["command"]
    assert router[router.index("--prefill") + 1 : router.index("--prefill") + 3] == [
        f"http://prefill:{launches['prefill']['port']}",
        str(launches["prefill"]["bootstrap"]),
    ]
    assert router[router.index("--decode") + 1] == f"http://decode:{launches['decode']['port']}"
    # the secret service: the demo's, on this image
    assert services["secret"]["volumes"] == ["auth:/run/pdstate"]


def test_prometheus_scrapes_every_rank(compose, tmp_path):
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    for role in ROLES:
        svc = compose["services"][role]
        tp = _launch(svc["command"])["tp"]
        base = _settings(role, _compose_env(svc), tmp_path).http_port
        (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == f"pdstate-sglang-{role}"]
        assert job["metrics_path"] == "/metrics"
        got = [(c["targets"], c["labels"]) for c in job["static_configs"]]
        assert got == [([f"127.0.0.1:{base + r}"], {"role": role, "rank": str(r)}) for r in range(tp)]


# --- kubernetes ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    docs = {}
    for name in kust["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc:
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


KINDS = {
    "Deployment": "apps/v1",
    "Service": "v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "PodMonitor": "monitoring.coreos.com/v1",
}


def test_k8s_documents_have_the_shape_of_their_kinds(k8s):
    for (kind, name), doc in k8s.items():
        assert KINDS[kind] == doc["apiVersion"] and NAME.match(name) and len(name) <= 63, (kind, name)
        assert set(doc) <= {"apiVersion", "kind", "metadata", "spec"}
        if kind == "Deployment":
            spec = doc["spec"]
            assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
            for c in spec["template"]["spec"]["containers"]:
                names = [p["name"] for p in c["ports"]]
                assert len(set(names)) == len(names) and all(PORT_NAME.match(n) and len(n) <= 15 for n in names)
                assert all(0 < p["containerPort"] < 65536 for p in c["ports"])
                mounts = {m["name"] for m in c["volumeMounts"]}
                assert mounts <= {v["name"] for v in spec["template"]["spec"]["volumes"]}
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                    handler = set(c[probe]) & {"httpGet", "exec", "tcpSocket", "grpc"}
                    assert len(handler) == 1, (name, probe)
                    if "httpGet" in c[probe]:
                        assert c[probe]["httpGet"]["port"] in names
        if kind == "Service":
            dep = k8s[("Deployment", name)]
            assert doc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
            (c,) = dep["spec"]["template"]["spec"]["containers"]
            assert {p["targetPort"] for p in doc["spec"]["ports"]} <= {p["name"] for p in c["ports"]}


def test_k8s_deployments_serve_every_rank_endpoint(k8s, routes, tmp_path, capsys):
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (image,) = kust["images"]
    lines = {}
    rank_ports = {}
    for role in ROLES:
        dep = k8s[("Deployment", f"pdstate-sglang-{role}")]
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        assert c["image"] == image["name"] == "pdstate-sglang" and image["newTag"] in SUPPORTED_RELEASES
        launch = _launch(c["command"])
        lines[role] = shlex.join(c["command"])
        assert launch["mode"] == role and launch["backend"] == "pdstate"
        env = {e["name"]: e.get("value", "") for e in c["env"]}
        s = _settings(role, env, tmp_path)
        assert s.engine == "mooncake" and s.token == TOKEN.encode()
        assert s.http_host is None  # the rank's own address: the pod's, where its agent binds
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        ranks = [s.http_port + rank_number(t, launch["tp"]) for t in range(launch["tp"])]
        assert [ports[f"pdstate-r{r}"] for r in range(launch["tp"])] == ranks
        assert ports["http"] == launch["port"] and c["resources"]["limits"]["nvidia.com/gpu"] == launch["tp"]
        rank_ports[role] = ranks
        live = c["livenessProbe"]["exec"]["command"][-1]
        assert _ports_in(live) == ranks and "/healthz" in live and "/healthz" in routes
        ready = c["readinessProbe"]
        if role == "prefill":
            assert _ports_in(ready["exec"]["command"][-1]) == ranks and "/readyz" in ready["exec"]["command"][-1]
        else:  # a decode rank is 503 until its first request: SGLang's /health gates traffic
            assert ready["httpGet"] == {"path": "/health", "port": "http"}
        auth = next(m for m in c["volumeMounts"] if env["PDSTATE_AUTH__TOKEN_FILE"].startswith(m["mountPath"]))
        vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == auth["name"])
        (gen,) = kust["secretGenerator"]
        assert vol["secret"]["secretName"] == gen["name"] and gen["files"] == ["token"]
    assert check_sglang(lines["prefill"], lines["decode"], [], strict=True, timeout_s=5, releases=["0.5.19"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("compatible")
    # Prometheus scrapes every rank port of both servers (the same port names on both)
    pm = k8s[("PodMonitor", "pdstate-sglang-ranks")]
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == [f"pdstate-r{r}" for r in range(4)]
    assert {e["path"] for e in pm["spec"]["podMetricsEndpoints"]} == {"/metrics"} <= routes
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "pdstate-sglang"}
    # the network policy: every port between the pair's pods, only SGLang's HTTP and the rank
    # endpoints from elsewhere
    np = k8s[("NetworkPolicy", "pdstate-sglang-peers-only")]
    peers, open_ports = np["spec"]["ingress"]
    assert peers == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pdstate-sglang"}}}]}
    allowed = set()
    for p in open_ports["ports"]:
        allowed |= set(range(p["port"], p.get("endPort", p["port"]) + 1))
    assert allowed == {30000, *rank_ports["prefill"], *rank_ports["decode"]}
    assert ("Service", "pdstate-sglang-prefill") in k8s and ("Service", "pdstate-sglang-decode") in k8s


def test_k8s_token_is_an_operator_file():
    text = (K8S / "kustomization.yaml").read_text()
    assert "openssl rand -hex 32 > deploy/sglang/k8s/token" in text
    ignored = subprocess.run(["git", "check-ignore", "-q", str(K8S / "token")], cwd=REPO, capture_output=True)
    assert ignored.returncode == 0, "deploy/sglang/k8s/token must be git-ignored"
    for path in K8S.glob("*.yaml"):
        assert all(not (d and d.get("kind") == "Secret") for d in yaml.safe_load_all(path.read_text())), path

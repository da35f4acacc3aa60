"""deploy/kubernetes: every manifest is valid against Kubernetes' own schemas (kubernetes-validate, strict:
unknown fields fail), and it stays in step with agl: its commands parse with agl's own command line, the
probes hit a route the store server serves without a token, the token and the password come from the
Secret, and the runners' grace period outlasts their --stop-timeout. No cluster runs here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator, List

import kubernetes_validate
import pytest
import yaml

from agl.cli import build_parser
from agl.store import InMemoryLightningStore
from agl.store.http.server import create_app

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES = "1.30.0"  # the oldest minor release still maintained upstream when this was written


def documents() -> List[Dict[str, Any]]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def containers(kind: str = "") -> Iterator[Dict[str, Any]]:
    for doc in documents():
        if doc["kind"] in ("Deployment", "StatefulSet", "Job") and (not kind or doc["metadata"]["name"] == kind):
            yield from doc["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_manifest_is_valid_kubernetes(doc: Dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_a_broken_manifest_is_caught() -> None:
    doc = next(d for d in documents() if d["kind"] == "Deployment")
    broken = {**doc, "spec": {**doc["spec"], "replica": 2}}  # a typo of replicas
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_the_agl_commands_parse_with_agls_own_command_line() -> None:
    commands = [c["command"] for c in containers() if c.get("command", [""])[0] == "agl"]
    assert {tuple(c[:2]) for c in commands} == {("agl", "store"), ("agl", "runner")}
    for command in commands:
        build_parser().parse_args(command[1:])  # an unknown or misspelt option exits 2


def test_probes_hit_the_servers_unauthenticated_health_route() -> None:
    routes = {route.path for route in create_app(InMemoryLightningStore(), allow_anonymous=True).routes}
    (store,) = containers("agl-store")
    for probe in ("readinessProbe", "livenessProbe"):
        assert store[probe]["httpGet"]["path"] in routes
        assert store[probe]["httpGet"]["port"] == int(store["command"][store["command"].index("--port") + 1])


def test_secrets_come_from_the_secret_and_the_grace_period_outlasts_the_stop_timeout() -> None:
    secret = next(d for d in documents() if d["kind"] == "Secret")
    for container in containers():
        for env in container.get("env", []):
            if env["name"] in ("AGL_STORE_TOKEN", "PGPASSWORD", "POSTGRES_PASSWORD"):
                ref = env["valueFrom"]["secretKeyRef"]
                assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
        assert "--token" not in container.get("command", [])  # a token in a command line shows in `ps`
    runners = next(d for d in documents() if d["metadata"]["name"] == "agl-runners")
    (runner,) = runners["spec"]["template"]["spec"]["containers"]
    stop_timeout = float(runner["command"][runner["command"].index("--stop-timeout") + 1])
    assert runners["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > stop_timeout

"""deploy/: the Kubernetes manifests validate against Kubernetes' schemas, and what they expect of
kvd (the port --http serves, the probe paths) exists in kvd."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from kubernetes_validate.utils import latest_version  # type: ignore[import-untyped]

from conftest import ROOT, Daemon, _stop_checked
from test_http import free_port

K8S = ROOT / "deploy" / "k8s"


def docs(name: str) -> list[dict[str, Any]]:
    with open(K8S / name) as f:
        return [d for d in yaml.safe_load_all(f) if d]


@pytest.mark.parametrize("name", ["deployment.yaml", "service.yaml"])
def test_core_manifests_validate(name: str) -> None:
    for d in docs(name):
        kubernetes_validate.validate(d, latest_version(), strict=True)


def test_gateway_manifests_name_the_pool() -> None:
    kinds = {d["kind"]: d for d in docs("inferencepool.yaml")}
    assert set(kinds) == {"InferencePool", "HTTPRoute"}
    pool = kinds["InferencePool"]
    app = docs("deployment.yaml")[0]["spec"]["template"]["metadata"]["labels"]["app"]
    assert pool["spec"]["selector"]["matchLabels"]["app"] == app
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [8000]
    backend = kinds["HTTPRoute"]["spec"]["rules"][0]["backendRefs"][0]
    assert backend["kind"] == "InferencePool" and backend["name"] == pool["metadata"]["name"]


def entrypoint_http_port() -> int:
    """The port of --http in the image's entrypoint."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    at = text.index('"--http", "') + len('"--http", "')
    return int(text[at:text.index('"', at)].rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    d = Daemon(tmp_path_factory.mktemp("kvd-deploy"), "--http", f"127.0.0.1:{port}", "--kv-memory", "16MiB",
               "-w", "1")
    yield port
    _stop_checked(d)


def test_probes_exist_in_kvd(served: int) -> None:
    container = docs("deployment.yaml")[0]["spec"]["template"]["spec"]["containers"][0]
    ports = {p["containerPort"] for p in container["ports"]}
    args = container["args"]
    events_port = int(args[args.index("--kv-events") + 1].rsplit(":", 1)[1])
    assert ports == {entrypoint_http_port(), events_port}
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == entrypoint_http_port()
        c = http.client.HTTPConnection("127.0.0.1", served, timeout=60)
        c.request("GET", get["path"])
        r = c.getresponse()
        r.read()
        c.close()
        assert r.status == 200, (probe, get["path"], r.status)

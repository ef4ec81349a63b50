"""deploy/: the kustomization for clusters without the OSC tooling renders with the kubectl that
CI installs, every object validates offline, and the Deployment agrees with the server, the image
and the descriptor (Guaranteed QoS, probes, ports, config map, metrics annotations, non-root)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath

import pytest

from ricllm.config import DEFAULT_HTTP_PORT, DEFAULT_ZMQ_PORT
from tests.serve.kube import render_kustomization, validation_errors

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
DESCRIPTOR = json.loads((ROOT / "xapp_descriptor" / "config-file.json").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render_kustomization(DEPLOY)


def _one(objects: list[dict], kind: str) -> dict:
    (found,) = [obj for obj in objects if obj["kind"] == kind]
    return found


def _container(objects: list[dict]) -> dict:
    (container,) = _one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _port_number(container: dict, port: int | str) -> int:
    """A probe's or Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def _cpus(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_every_object_validates_offline(objects):
    assert sorted(obj["kind"] for obj in objects) == ["ConfigMap", "Deployment", "Service", "Service"]
    assert [error for obj in objects for error in validation_errors(obj)] == []
    assert {obj["metadata"]["namespace"] for obj in objects} == {"ricxapp"}


def test_validation_catches_a_broken_object(objects):
    """The offline check is not vacuous: a wrong type and an unknown field are both found."""
    deployment = json.loads(json.dumps(_one(objects, "Deployment")))
    deployment["spec"]["replicas"] = "one"
    assert validation_errors(deployment)
    service = json.loads(json.dumps(next(obj for obj in objects if obj["kind"] == "Service")))
    service["spec"]["portz"] = []
    assert validation_errors(service)


def test_guaranteed_qos_with_whole_cpus(objects):
    resources = _container(objects)["resources"]
    assert resources["requests"] == resources["limits"]  # every container: Guaranteed QoS
    assert set(resources["limits"]) >= {"cpu", "memory"}
    cpus = _cpus(str(resources["limits"]["cpu"]))
    assert cpus >= 2 and cpus.is_integer()  # the static CPU manager gives whole CPUs of their own


def test_engine_cpus_fit_the_pods_cpus_and_leave_one_for_the_server(objects, monkeypatch):
    """deploy/config-file.json is what the server reads; its engine_cpus count within the pod's
    cpuset, whichever CPUs the node gives it, and leave the server's other threads a CPU."""
    from ricllm.affinity import parse_cpu_list
    from ricllm.config import resolve_settings

    cpus = int(_cpus(str(_container(objects)["resources"]["limits"]["cpu"])))
    cpuset = set(range(20, 20 + cpus))  # as the static CPU manager might hand them out
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpuset))
    controls = json.loads((DEPLOY / "config-file.json").read_text())["controls"]
    engine_cpus = parse_cpu_list(controls["engine_cpus"])
    assert max(engine_cpus) < cpus and len(engine_cpus) < cpus
    settings = resolve_settings(config_file=str(DEPLOY / "config-file.json"), environ={})
    assert settings.engine_config().engine_cpus == tuple(sorted(cpuset))[-len(engine_cpus):]


def test_the_config_map_is_mounted_where_config_file_points(objects):
    container = _container(objects)
    env = {item["name"]: item["value"] for item in container["env"]}
    config_file = PurePosixPath(env["CONFIG_FILE"])
    assert f"CONFIG_FILE={config_file}" in DOCKERFILE  # the image's default, too
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config_file.parent)]
    volumes = {v["name"]: v for v in _one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    config_map = _one(objects, "ConfigMap")
    assert volumes[mount["name"]]["configMap"]["name"] == config_map["metadata"]["name"]
    assert json.loads(config_map["data"][config_file.name]) == json.loads((DEPLOY / "config-file.json").read_text())


def test_probes_ask_the_port_and_paths_the_server_serves(objects):
    container = _container(objects)
    for probe, descriptor_probe in (("livenessProbe", "livenessProbe"), ("readinessProbe", "readinessProbe")):
        http = container[probe]["httpGet"]
        assert _port_number(container, http["port"]) == DEFAULT_HTTP_PORT
        assert http["path"] == DESCRIPTOR[descriptor_probe]["httpGet"]["path"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ric/v1/health/ready"


def test_the_services_expose_the_zeromq_and_http_ports(objects):
    container = _container(objects)
    pod_labels = _one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    services = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Service"}
    exposed = {}
    for name, service in services.items():
        assert service["spec"]["selector"].items() <= pod_labels.items()
        for port in service["spec"]["ports"]:
            assert _port_number(container, port["targetPort"]) == port["port"]
            exposed[name] = port["port"]
    # named as the OSC xApp chart names them for release ricllm in namespace ricxapp
    assert exposed == {"service-ricxapp-ricllm-zmq": DEFAULT_ZMQ_PORT, "service-ricxapp-ricllm-http": DEFAULT_HTTP_PORT}
    assert {p["containerPort"] for p in container["ports"]} == {DEFAULT_ZMQ_PORT, DEFAULT_HTTP_PORT}


def test_prometheus_annotations_point_at_the_metrics(objects):
    annotations = _one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    expected = {"prometheus.io/scrape": "true", "prometheus.io/port": str(DEFAULT_HTTP_PORT),
                "prometheus.io/path": DESCRIPTOR["metrics"]["url"]}
    assert {key: annotations[key] for key in expected} == expected
    assert {key: DESCRIPTOR["annotations"][key] for key in expected} == expected  # the OSC chart's pods, too


def test_runs_as_the_images_non_root_user(objects):
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    container = _container(objects)
    uid, gid = re.search(r"^USER (\d+):(\d+)$", DOCKERFILE, re.MULTILINE).groups()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (int(uid), int(gid)) != (0, 0)
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_the_image_is_the_descriptors(objects):
    image = DESCRIPTOR["containers"][0]["image"]
    assert _container(objects)["image"] == f"{image['registry']}/{image['name']}:{image['tag']}"


def test_drain_fits_the_termination_grace_period(objects):
    from ricllm.config import ServerOptions

    grace = _one(objects, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert ServerOptions().drain_timeout_s < grace

"""The O-RAN xApp descriptor: what the OSC onboarder checks, our controls schema, and agreement
with the Dockerfile, the protocol defaults and the engine's own defaults."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from ricllm.config import DEFAULT_HTTP_PORT, DEFAULT_ZMQ_PORT
from tests.helpers import require_module

ROOT = Path(__file__).parents[2]
DESCRIPTOR = json.loads((ROOT / "xapp_descriptor" / "config-file.json").read_text())
SCHEMA = json.loads((ROOT / "xapp_descriptor" / "schema.json").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()

# The OSC App Manager's onboarder (o-ran-sc/ric-plt-appmgr, xapp_orchestrater/dev/xapp_onboarder:
# helm_controller/xapp_schema.py, api/onboard.py) checks config-file.json with one draft-07 schema,
# restated here from its facts; what it does not check is left out, stricter rules of our own are
# separate tests. It requires no top-level section (xApp_builder then needs `name` and `version`);
# it puts the uploaded schema.json in place of its `controls` rule before validating.
# Version: semver 2.0.0 (no leading zeros, optional pre-release and build parts).
_NUMBER = r"(0|[1-9][0-9]*)"
_PRE_ID = r"(0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*)"
SEMVER = (rf"^{_NUMBER}\.{_NUMBER}\.{_NUMBER}(-{_PRE_ID}(\.{_PRE_ID})*)?"
          r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?$")
# Registry: a host name with at least one dot and an all-letter last label, or a dotted quad whose
# parts are 0-255 (up to three digits, leading zeros allowed); then an optional `:digits`. So a
# bare name (`localhost`, `registry`) is refused, with or without a port, and so is any path.
_OCTET = r"(25[0-5]|2[0-4][0-9]|[01]?[0-9]{1,2})"
REGISTRY = rf"^([-.0-9A-Za-z]+\.[A-Za-z]+|({_OCTET}\.){{3}}{_OCTET})(:\d+)?$"
_STRINGS_FIRST = {"type": "array", "items": [{"type": "string"}]}  # draft-07 tuple form: only item 0 is typed


def _probe() -> dict:
    timing = ["initialDelaySeconds", "periodSeconds"]
    return {
        "type": "object",
        "properties": {
            "exec": {"type": "object", "required": ["command"], "properties": {"command": _STRINGS_FIRST}},
            "httpGet": {"type": "object", "required": ["path", "port"],
                        "properties": {"path": {"type": "string"}, "port": {"type": "integer"}}},
            "initialDelaySeconds": {"type": "integer"},
            "periodSeconds": {"type": "integer"},
        },
        "oneOf": [{"required": ["exec", *timing]}, {"required": ["httpGet", *timing]}],
    }


ONBOARDER = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "version": {"type": "string", "pattern": SEMVER},
        "annotations": {"type": "object", "additionalProperties": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}},
        "containers": {"type": "array", "items": {
            "type": "object", "required": ["name", "image"],
            "properties": {
                "name": {"type": "string"},
                "image": {"type": "object", "required": ["registry", "name", "tag"],
                          "properties": {"registry": {"type": "string", "pattern": REGISTRY},
                                         "name": {"type": "string"}, "tag": {"type": "string"}}},
                "command": _STRINGS_FIRST,
                "args": _STRINGS_FIRST}}},
        "livenessProbe": _probe(),
        "readinessProbe": _probe(),
        "messaging": {"type": "object", "required": ["ports"], "properties": {"ports": {
            "type": "array", "items": {
                "type": "object", "required": ["name", "container", "port"],
                "properties": {"name": {"type": "string"}, "container": {"type": "string"},
                               "port": {"type": "integer"}, "description": {"type": "string"},
                               "txMessages": {"type": "array", "items": {"type": "string"}},
                               "rxMessages": {"type": "array", "items": {"type": "string"}},
                               "policies": {"type": "array", "items": {"type": "integer"}}},
                "dependencies": {"txMessages": ["rxMessages", "policies"],
                                 "rxMessages": ["txMessages", "policies"],
                                 "policies": ["txMessages", "rxMessages"]}}}}},
        "metrics": {"type": "object"},
        # replaced by the uploaded schema.json (see _onboarding_schema); without one, the onboarder
        # demands a marker key, i.e. an xApp with controls must upload their schema
        "controls": {"required": ["__empty_control_section__"]},
    },
}


def _onboarding_schema() -> dict:
    """What `dms_cli onboard config-file.json schema.json` validates the descriptor with."""
    return {**ONBOARDER, "properties": {**ONBOARDER["properties"], "controls": SCHEMA}}


def _draft7(schema: dict):
    """jsonschema is a test tool, not a runtime dependency: skipped locally without it, failed in CI."""
    require_module("jsonschema")
    import jsonschema

    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _onboarder_errors(descriptor: dict) -> list[str]:
    return [e.message for e in _draft7(_onboarding_schema()).iter_errors(descriptor)]


def _controls_errors(controls: dict) -> list[str]:
    return [e.message for e in _draft7(SCHEMA).iter_errors(controls)]


def _ports() -> dict[str, int]:
    return {p["name"]: p["port"] for p in DESCRIPTOR["messaging"]["ports"]}


def test_schemas_are_valid_draft_07():
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    _draft7(SCHEMA)  # check_schema raises SchemaError on an invalid schema
    _draft7(ONBOARDER)


def test_controls_validate_against_schema_json():
    assert _controls_errors(DESCRIPTOR["controls"]) == []


def test_descriptor_passes_the_onboarder_rules():
    assert _onboarder_errors(DESCRIPTOR) == []
    assert DESCRIPTOR["name"] == "ricllm" and DESCRIPTOR["version"] == "0.1.0"  # xApp_builder needs both
    containers = {c["name"] for c in DESCRIPTOR["containers"]}
    assert {p["container"] for p in DESCRIPTOR["messaging"]["ports"]} <= containers
    assert DESCRIPTOR["metrics"] == {"url": "/ric/v1/metrics", "namespace": "ricxapp"}


@pytest.mark.parametrize("version, accepted", [
    ("0.1.0", True), ("10.20.30", True), ("1.0.0-rc.1", True), ("1.0.0-alpha-beta.0.x7", True),
    ("1.0.0+build.5", True), ("1.0.0-rc.1+build.5", True),
    ("0.1", False), ("v0.1.0", False), ("01.1.0", False), ("1.0.0-01", False), ("1.0.0-", False),
    ("1.0.0+", False), ("1.0.0.0", False), ("1.0.0 ", False),
])
def test_onboarder_version_pattern(version, accepted):
    descriptor = copy.deepcopy(DESCRIPTOR)
    descriptor["version"] = version
    errors = _onboarder_errors(descriptor)
    assert (errors == []) == accepted, errors
    assert accepted or any("does not match" in e for e in errors)


@pytest.mark.parametrize("registry, accepted", [
    ("127.0.0.1:5000", True), ("10.0.0.1", True), ("010.001.0.1:5000", True),
    ("nexus3.o-ran-sc.org:10002", True), ("registry.local:5000", True), ("docker.io", True), ("my-reg.example.com", True),
    ("localhost:5000", False), ("localhost", False), ("registry:5000", False),  # no dot: refused
    ("256.0.0.1:5000", False), ("1.2.3.4.5", False), ("registry.local5", False),  # last label must be letters
    ("http://registry/", False), ("nexus.example.org/ric", False), ("my_registry.org", False),
    ("registry.local:", False), ("registry.local:port", False),
])
def test_onboarder_registry_pattern(registry, accepted):
    descriptor = copy.deepcopy(DESCRIPTOR)
    descriptor["containers"][0]["image"]["registry"] = registry
    errors = _onboarder_errors(descriptor)
    assert (errors == []) == accepted, errors
    assert accepted or any("does not match" in e for e in errors)


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d["containers"][0]["image"].pop("tag"), "'tag' is a required property"),
    (lambda d: d["containers"][0].update(command=[1]), "is not of type 'string'"),
    (lambda d: d["livenessProbe"].update(exec={"command": ["true"]}), "valid under each of"),
    (lambda d: d["readinessProbe"].pop("httpGet"), "is not valid under any of the given schemas"),
    (lambda d: d["readinessProbe"].pop("periodSeconds"), "is not valid under any of the given schemas"),
    (lambda d: d["livenessProbe"]["httpGet"].update(port="http"), "is not of type 'integer'"),
    (lambda d: d["messaging"].pop("ports"), "'ports' is a required property"),
    (lambda d: d["messaging"]["ports"][0].pop("container"), "'container' is a required property"),
    (lambda d: d["messaging"]["ports"][0].update(port="5555"), "is not of type 'integer'"),
    (lambda d: d["messaging"]["ports"][0].update(txMessages=["A"]), "'rxMessages' is a dependency"),
    (lambda d: d["messaging"]["ports"][0].update(txMessages=[], rxMessages=[], policies=["1"]),
     "is not of type 'integer'"),
    (lambda d: d["annotations"].update(replicas=2), "is not valid under any of the given schemas"),
    (lambda d: d.update(metrics=[]), "is not of type 'object'"),
    (lambda d: d["controls"].update(block_size="16"), "is not of type 'integer'"),  # schema.json in place
])
def test_onboarder_rules_catch_broken_descriptors(mutate, needle):
    descriptor = copy.deepcopy(DESCRIPTOR)
    mutate(descriptor)
    assert any(needle in error for error in _onboarder_errors(descriptor)), _onboarder_errors(descriptor)


def test_all_three_message_lists_together_pass():
    descriptor = copy.deepcopy(DESCRIPTOR)
    descriptor["messaging"]["ports"][0].update(txMessages=[], rxMessages=[], policies=[])
    assert _onboarder_errors(descriptor) == []


def test_without_schema_json_the_onboarder_wants_the_empty_controls_marker():
    errors = [e.message for e in _draft7(ONBOARDER).iter_errors(DESCRIPTOR)]
    assert errors == ["'__empty_control_section__' is a required property"]


def test_name_makes_valid_kubernetes_names():
    """Not the onboarder's rule but the chart's: the name goes into Deployment, Service and
    ConfigMap names (service-ricxapp-ricllm-http), which must be DNS-1123 labels."""
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", DESCRIPTOR["name"])
    assert len(f"service-ricxapp-{DESCRIPTOR['name']}-rmr") <= 63


def _osc_chart_ports(descriptor: dict) -> tuple[list[dict], dict[str, list[dict]], list[dict]]:
    """How the OSC xApp chart (xapp_onboarder/resources/xapp-std) turns `messaging.ports` into
    Kubernetes objects: each port becomes a named containerPort of its container; the one RMR
    Service gets every port whose name contains "rmr" (rmrdata first); every other port gets a
    Service of its own. Returns (RMR Service ports, {port name: Service ports}, container ports)."""
    def service_port(port: dict) -> dict:
        return {"name": port["name"], "port": port["port"], "targetPort": port["name"], "protocol": "TCP"}

    ports = descriptor["messaging"]["ports"]
    rmr = ([p for p in ports if p["name"] == "rmrdata"]
           + [p for p in ports if "rmr" in p["name"] and p["name"] != "rmrdata"])
    others = {p["name"]: [service_port(p)] for p in ports if "rmr" not in p["name"]}
    container = [{"name": p["name"], "containerPort": p["port"], "protocol": "TCP"} for p in ports]
    return [service_port(p) for p in rmr], others, container


def test_the_osc_charts_rmr_service_has_ports():
    """The chart always creates the RMR Service; the API server refuses a ClusterIP Service
    without ports, so `dms_cli install` needs rmrdata/rmrroute even though nothing serves RMR."""
    rmr, _, container = _osc_chart_ports(DESCRIPTOR)
    assert [(p["name"], p["port"]) for p in rmr] == [("rmrdata", 4560), ("rmrroute", 4561)]
    assert {p["targetPort"] for p in rmr} <= {p["name"] for p in container}


def test_the_osc_charts_objects_validate_offline():
    from tests.serve.kube import validation_errors

    rmr, others, container_ports = _osc_chart_ports(DESCRIPTOR)
    labels = {"app": f"ricxapp-{DESCRIPTOR['name']}", "release": DESCRIPTOR["name"]}
    services = [{"apiVersion": "v1", "kind": "Service",
                 "metadata": {"name": f"service-ricxapp-{DESCRIPTOR['name']}-{suffix}", "namespace": "ricxapp"},
                 "spec": {"type": "ClusterIP", "ports": ports, "selector": labels}}
                for suffix, ports in [("rmr", rmr), *others.items()]]
    probes = {name: DESCRIPTOR[name] for name in ("livenessProbe", "readinessProbe")}
    container = {"name": DESCRIPTOR["containers"][0]["name"], "image": "{registry}/{name}:{tag}".format(
        **DESCRIPTOR["containers"][0]["image"]), "ports": container_ports, **probes}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                  "metadata": {"name": f"ricxapp-{DESCRIPTOR['name']}", "namespace": "ricxapp"},
                  "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
                      "metadata": {"labels": labels, "annotations": DESCRIPTOR["annotations"]},
                      "spec": {"containers": [container]}}}}
    assert [error for obj in [deployment, *services] for error in validation_errors(obj)] == []
    # port names are IANA service names: at most 15 characters, lower case, a letter among them
    assert all(re.fullmatch(r"(?=.*[a-z])[a-z0-9]([-a-z0-9]*[a-z0-9])?", p["name"]) and len(p["name"]) <= 15
               for p in container_ports)


def test_ports_agree_with_protocol_dockerfile_and_controls():
    """ZeroMQ and HTTP are served; rmrdata and rmrroute are declared for the OSC chart only
    (docs/deploy.md), so the image does not EXPOSE them."""
    controls = DESCRIPTOR["controls"]
    served = {name: port for name, port in _ports().items() if "rmr" not in name}
    assert served == {"zmq": DEFAULT_ZMQ_PORT, "http": DEFAULT_HTTP_PORT} == {"zmq": 5555, "http": 8080}
    assert {name: port for name, port in _ports().items() if "rmr" in name} == {"rmrdata": 4560, "rmrroute": 4561}
    assert controls["zmq_endpoint"].rsplit(":", 1)[1] == str(DEFAULT_ZMQ_PORT)
    assert controls["http_port"] == DEFAULT_HTTP_PORT
    exposed = re.search(r"^EXPOSE\s+(.+)$", DOCKERFILE, re.MULTILINE).group(1).split()
    assert sorted(int(p) for p in exposed) == sorted(served.values())


def test_probes_agree_with_the_dockerfile_healthcheck():
    alive, ready = DESCRIPTOR["livenessProbe"]["httpGet"], DESCRIPTOR["readinessProbe"]["httpGet"]
    assert (alive["path"], ready["path"]) == ("/ric/v1/health/alive", "/ric/v1/health/ready")
    assert alive["port"] == ready["port"] == DESCRIPTOR["controls"]["http_port"]
    healthcheck = re.search(r"^HEALTHCHECK .*$", DOCKERFILE.replace("\\\n", " "), re.MULTILINE).group(0)
    assert f"http://127.0.0.1:{alive['port']}{alive['path']}" in healthcheck


def test_controls_defaults_are_the_engines():
    """The descriptor's controls are the engine's defaults, but for what the serve profile overrides."""
    from ricllm.config import SERVE_PROFILE, EngineSettings, ServerOptions, merge_layers

    defaults = merge_layers(EngineSettings().model_dump(mode="json"), SERVE_PROFILE)
    controls = DESCRIPTOR["controls"]
    assert {name: controls[name] for name in defaults} == defaults
    assert controls["admission"]["policy"] == "deadline" != EngineSettings().admission.policy
    assert controls["drain_timeout_s"] == ServerOptions().drain_timeout_s


def test_schema_json_is_the_one_generated_from_the_settings_model():
    from ricllm.serve.descriptor import controls_schema

    assert SCHEMA == controls_schema(), ("xapp_descriptor/schema.json is out of date: "
                                         "python -m ricllm.serve.descriptor xapp_descriptor/schema.json")


def test_schema_enums_are_what_the_engine_accepts():
    from ricllm.attention.backends import BACKENDS
    from ricllm.config import DTYPES

    properties = SCHEMA["properties"]
    assert set(properties["attention_backend"]["enum"]) == set(BACKENDS)
    assert set(properties["dtype"]["enum"]) == {"auto", *DTYPES}


@pytest.mark.parametrize("size", ["256MiB", "1.5GB", "1024", "4g", "12 KiB", "2TiB", "512mb",
                                  "abc", "256XB", "-1MiB", "MiB", "2t", "1.5.2GB"])
def test_kv_budget_pattern_matches_the_parser(size):
    from ricllm.errors import ConfigError
    from ricllm.units import parse_bytes

    try:
        parse_bytes(size)
        parses = True
    except ConfigError:
        parses = False
    controls = {**DESCRIPTOR["controls"], "kv_cache_budget": size}
    assert (_controls_errors(controls) == []) == parses


@pytest.mark.parametrize("change", [
    {"block_size": "16"},
    {"block_size": -16},
    {"block_size": 0},
    {"blocksize": 16},
    {"dtype": "int3"},
    {"device": "tpu"},
    {"http_port": 70000},
    {"threads": 0},
    {"enable_prefix_caching": "yes"},
    {"zmq_endpoint": "udp://0.0.0.0:5555"},
    {"admission": {"policy": "deadline", "safety_margin": 0.1, "max_queue": 256, "priority": 1}},
    {"admission": {"policy": "edf", "safety_margin": 0.1, "max_queue": 256}},
    {"admission": {"policy": "deadline", "safety_margin": -0.1, "max_queue": 256}},
    {"curve": {"enabled": True, "server_secret_key_file": None, "authorized_keys_dir": "/keys"}},
    {"curve": {"enabled": False}},
])
def test_invalid_controls_are_rejected(change):
    assert _controls_errors({**DESCRIPTOR["controls"], **change})


def test_missing_control_is_rejected():
    controls = dict(DESCRIPTOR["controls"])
    del controls["kv_cache_budget"]
    assert any("'kv_cache_budget' is a required property" in e for e in _controls_errors(controls))


def test_curve_enabled_with_keys_passes():
    curve = {"enabled": True, "server_secret_key_file": "/keys/server.key_secret",
             "authorized_keys_dir": "/keys/clients"}
    assert _controls_errors({**DESCRIPTOR["controls"], "curve": curve}) == []

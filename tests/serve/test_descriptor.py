"""The O-RAN xApp descriptor: what the OSC onboarder checks, our controls schema, and agreement
with the Dockerfile, the protocol defaults and the engine's own defaults."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from ricllm.serve.protocol import DEFAULT_HTTP_PORT, DEFAULT_ZMQ_PORT
from tests.helpers import require_module

ROOT = Path(__file__).parents[2]
DESCRIPTOR = json.loads((ROOT / "xapp_descriptor" / "config-file.json").read_text())
SCHEMA = json.loads((ROOT / "xapp_descriptor" / "schema.json").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()

SEMVER = (r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
          r"(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$")
REGISTRY = (r"^(([0-9]{1,3}\.){3}[0-9]{1,3}|[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?"
            r"(\.[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?)*)(:[0-9]{1,5})?$")
_PROBE = {
    "type": "object",
    "required": ["initialDelaySeconds", "periodSeconds"],
    "oneOf": [{"required": ["exec"]}, {"required": ["httpGet"]}],
    "properties": {
        "exec": {"type": "object", "required": ["command"]},
        "httpGet": {"type": "object", "required": ["path", "port"],
                    "properties": {"path": {"type": "string"}, "port": {"type": "integer"}}},
        "initialDelaySeconds": {"type": "integer", "minimum": 0},
        "periodSeconds": {"type": "integer", "minimum": 1},
    },
}
# The structural rules of the OSC App Manager's onboarder (docs: /work/shared/reference/oran.md),
# written as the draft-07 schema it validates with. Extra top-level sections pass.
ONBOARDER = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "required": ["name", "version", "containers", "livenessProbe", "readinessProbe", "messaging", "metrics",
                 "controls"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([a-z0-9-]*[a-z0-9])?$"},
        "version": {"type": "string", "pattern": SEMVER},
        "annotations": {"type": "object"},
        "containers": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "image"],
            "properties": {"name": {"type": "string"}, "image": {
                "type": "object", "required": ["registry", "name", "tag"],
                "properties": {"registry": {"type": "string", "pattern": REGISTRY}, "name": {"type": "string"},
                               "tag": {"type": "string"}}}}}},
        "livenessProbe": _PROBE,
        "readinessProbe": _PROBE,
        "messaging": {"type": "object", "required": ["ports"], "properties": {"ports": {
            "type": "array", "items": {
                "type": "object", "required": ["name", "container", "port"],
                "properties": {"name": {"type": "string"}, "container": {"type": "string"},
                               "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
                "dependencies": {"txMessages": ["rxMessages", "policies"],
                                 "rxMessages": ["txMessages", "policies"],
                                 "policies": ["txMessages", "rxMessages"]}}}}},
        "metrics": {"type": "object"},
        "controls": {"type": "object"},
    },
}


def _draft7(schema: dict):
    """jsonschema is a test tool, not a runtime dependency: skipped locally without it, failed in CI."""
    require_module("jsonschema")
    import jsonschema

    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _onboarder_errors(descriptor: dict) -> list[str]:
    return [e.message for e in _draft7(ONBOARDER).iter_errors(descriptor)]


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
    assert DESCRIPTOR["name"] == "ricllm" and DESCRIPTOR["version"] == "0.1.0"
    containers = {c["name"] for c in DESCRIPTOR["containers"]}
    assert {p["container"] for p in DESCRIPTOR["messaging"]["ports"]} <= containers
    assert DESCRIPTOR["metrics"] == {"url": "/ric/v1/metrics", "namespace": "ricxapp"}


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(version="0.1"), "does not match"),
    (lambda d: d["containers"][0]["image"].pop("tag"), "'tag' is a required property"),
    (lambda d: d["containers"][0]["image"].update(registry="http://registry/"), "does not match"),
    (lambda d: d["livenessProbe"].update(exec={"command": ["true"]}), "valid under each of"),
    (lambda d: d["readinessProbe"].pop("httpGet"), "is not valid under any of the given schemas"),
    (lambda d: d["readinessProbe"].pop("periodSeconds"), "'periodSeconds' is a required property"),
    (lambda d: d["messaging"]["ports"][0].pop("container"), "'container' is a required property"),
    (lambda d: d["messaging"]["ports"][0].update(txMessages=["A"]), "'rxMessages' is a dependency"),
])
def test_onboarder_rules_catch_broken_descriptors(mutate, needle):
    descriptor = copy.deepcopy(DESCRIPTOR)
    mutate(descriptor)
    assert any(needle in error for error in _onboarder_errors(descriptor)), _onboarder_errors(descriptor)


def test_all_three_message_lists_together_pass():
    descriptor = copy.deepcopy(DESCRIPTOR)
    descriptor["messaging"]["ports"][0].update(txMessages=[], rxMessages=[], policies=[])
    assert _onboarder_errors(descriptor) == []


def test_ports_agree_with_protocol_dockerfile_and_controls():
    controls = DESCRIPTOR["controls"]
    assert _ports() == {"zmq": DEFAULT_ZMQ_PORT, "http": DEFAULT_HTTP_PORT} == {"zmq": 5555, "http": 8080}
    assert controls["zmq_endpoint"].rsplit(":", 1)[1] == str(DEFAULT_ZMQ_PORT)
    assert controls["http_port"] == DEFAULT_HTTP_PORT
    exposed = re.search(r"^EXPOSE\s+(.+)$", DOCKERFILE, re.M).group(1).split()
    assert sorted(int(p) for p in exposed) == sorted(_ports().values())


def test_probes_agree_with_the_dockerfile_healthcheck():
    alive, ready = DESCRIPTOR["livenessProbe"]["httpGet"], DESCRIPTOR["readinessProbe"]["httpGet"]
    assert (alive["path"], ready["path"]) == ("/ric/v1/health/alive", "/ric/v1/health/ready")
    assert alive["port"] == ready["port"] == DESCRIPTOR["controls"]["http_port"]
    healthcheck = re.search(r"^HEALTHCHECK .*$", DOCKERFILE.replace("\\\n", " "), re.M).group(0)
    assert f"http://127.0.0.1:{alive['port']}{alive['path']}" in healthcheck


def test_controls_defaults_are_the_engines():
    """The descriptor's controls are the engine's defaults, but for what the serve profile overrides."""
    from ricllm.config import EngineSettings
    from ricllm.serve.settings import SERVE_PROFILE, ServerOptions, merge_layers

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

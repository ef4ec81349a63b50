"""Settings of ``ricllm serve``: the pydantic controls model agrees with schema.json, layers merge
by precedence (flags > --config > $CONFIG_FILE > defaults), and every error names its field."""

from __future__ import annotations

import argparse
import copy
import json
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from ricllm.cli.serve import settings_from_args
from ricllm.config import AdmissionSettings, CurveOptions, CurveSettings, ServeSettings, SettingsError, flatten_settings

ROOT = Path(__file__).parents[2]
DESCRIPTOR = json.loads((ROOT / "xapp_descriptor" / "config-file.json").read_text())
SCHEMA = json.loads((ROOT / "xapp_descriptor" / "schema.json").read_text())


def parse(*argv: str) -> argparse.Namespace:
    from ricllm.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def descriptor_file(tmp_path: Path, name: str, **controls) -> Path:
    document = copy.deepcopy(DESCRIPTOR)
    document["controls"] = controls
    path = tmp_path / name
    path.write_text(json.dumps(document))
    return path


# ------------------------------------------------------------------------------ agreement with the schema

def test_the_descriptor_controls_are_valid_and_are_the_serve_defaults():
    assert ServeSettings.model_validate(DESCRIPTOR["controls"]) == settings_from_args(parse(), environ={}).controls


@pytest.mark.parametrize("model, schema", [
    (ServeSettings, SCHEMA),
    (AdmissionSettings, SCHEMA["properties"]["admission"]),
    (CurveSettings, SCHEMA["properties"]["curve"]),
])
def test_fields_are_the_schemas(model: type[BaseModel], schema: dict):
    assert set(model.model_fields) == set(schema["properties"])
    assert set(schema["required"]) <= set(model.model_fields)
    assert schema["additionalProperties"] is False and model.model_config["extra"] == "forbid"


def test_enums_are_the_schemas():
    properties = SCHEMA["properties"]
    for name in ("dtype", "weights", "attention_backend"):
        assert set(typing.get_args(ServeSettings.model_fields[name].annotation)) == set(properties[name]["enum"]), name
    policy = AdmissionSettings.model_fields["policy"].annotation
    assert set(typing.get_args(policy)) == set(properties["admission"]["properties"]["policy"]["enum"])


def test_the_byte_size_pattern_is_the_schemas():
    from ricllm.config import BYTE_SIZE_PATTERN

    assert BYTE_SIZE_PATTERN == SCHEMA["properties"]["kv_cache_budget"]["oneOf"][1]["pattern"]


@pytest.mark.parametrize("change, field", [
    ({"block_size": "16"}, "block_size"),
    ({"block_size": -16}, "block_size"),
    ({"block_size": 0}, "block_size"),
    ({"block_size": 2048}, "block_size"),
    ({"blocksize": 16}, "blocksize"),
    ({"dtype": "int3"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"http_port": 70000}, "http_port"),
    ({"threads": 0}, "threads"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ({"zmq_endpoint": "udp://0.0.0.0:5555"}, "zmq_endpoint"),
    ({"kv_cache_budget": "256XB"}, "kv_cache_budget"),
    ({"kv_cache_budget": 0}, "kv_cache_budget"),
    ({"kv_cache_budget": True}, "kv_cache_budget"),
    ({"log_json": 1}, "log_json"),
    ({"admission": {"policy": "deadline", "safety_margin": 0.1, "max_queue": 256, "priority": 1}},
     "admission.priority"),
    ({"admission": {"policy": "lifo", "safety_margin": 0.1, "max_queue": 256}}, "admission.policy"),
    ({"admission": {"policy": "deadline", "safety_margin": -0.1, "max_queue": 256}}, "admission.safety_margin"),
    ({"curve": {"enabled": True, "server_secret_key_file": None, "authorized_keys_dir": "/keys"}},
     "curve.server_secret_key_file"),
])
def test_invalid_controls_are_rejected_naming_the_field(tmp_path, change, field):
    """The same changes the schema rejects (tests/serve/test_descriptor.py), plus a few."""
    path = descriptor_file(tmp_path, "bad.json", **{**DESCRIPTOR["controls"], **change})
    with pytest.raises(SettingsError) as error:
        settings_from_args(parse("--config", str(path)), environ={})
    assert field in str(error.value) and f"--config {path}" in str(error.value)


def test_a_partial_controls_section_fills_in_defaults():
    assert ServeSettings.model_validate({"block_size": 32}).kv_cache_budget == "256MiB"


# ------------------------------------------------------------------------------ precedence

def test_flags_over_config_over_env_over_defaults(tmp_path):
    env_file = descriptor_file(tmp_path, "env.json", block_size=8, max_num_seqs=4,
                               admission={"policy": "deadline", "max_queue": 5}, http_port=9000)
    config_file = descriptor_file(tmp_path, "config.json", block_size=32, admission={"policy": "fcfs"},
                                  kv_cache_budget="64MiB", log_format="osc", drain_timeout_s=10.0)
    args = parse("--config", str(config_file), "--block-size", "64", "--zmq", "ipc:///tmp/x.sock",
                 "--drain-timeout", "5")
    settings = settings_from_args(args, environ={"CONFIG_FILE": str(env_file)})
    c = settings.controls
    assert c.block_size == 64  # flag
    assert c.admission.policy == "fcfs" and c.kv_cache_budget == "64MiB" and c.log_format == "osc"  # --config
    assert c.admission.max_queue == 5 and c.max_num_seqs == 4 and c.http_port == 9000  # CONFIG_FILE, nested merge
    assert c.admission.safety_margin == 0.1 and c.dtype == "auto"  # defaults
    assert settings.server.zmq_endpoint == "ipc:///tmp/x.sock" and settings.server.http_port == 9000
    assert c.drain_timeout_s == settings.server.drain_timeout_s == 5.0  # flag over --config
    assert settings.log_format == "osc"
    assert settings.sources["block_size"] == "command-line flags"  # where each came from, for /ric/v1/config
    assert settings.sources["admission.policy"] == f"--config {config_file}"
    assert settings.sources["admission.max_queue"] == f"CONFIG_FILE={env_file}"
    assert settings.sources["admission.safety_margin"] == "default"
    assert set(settings.sources) == set(flatten_settings(c.model_dump()))


@pytest.mark.parametrize("log_json, log_format", [(True, "json"), (False, "console")])
def test_a_config_written_before_log_format_still_reads(tmp_path, log_json, log_format):
    path = descriptor_file(tmp_path, "old.json", log_json=log_json)
    assert settings_from_args(parse("--config", str(path)), environ={}).log_format == log_format
    contradicting = descriptor_file(tmp_path, "both.json", log_json=log_json, log_format="osc")
    with pytest.raises(SettingsError, match="log_format"):
        settings_from_args(parse("--config", str(contradicting)), environ={})


def test_the_log_level_control_falls_back_to_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RICLLM_LOG_LEVEL", "debug")
    assert settings_from_args(parse(), environ={}).log_level == "DEBUG"  # as before the control existed
    path = descriptor_file(tmp_path, "level.json", log_level="ERROR")
    assert settings_from_args(parse("--config", str(path)), environ={}).log_level == "ERROR"
    monkeypatch.delenv("RICLLM_LOG_LEVEL")
    assert settings_from_args(parse(), environ={}).log_level == "INFO"


def test_only_flags_the_user_gave_override(tmp_path):
    config_file = descriptor_file(tmp_path, "config.json", block_size=32, enable_prefix_caching=False,
                                  admission={"policy": "off", "on_late": "abort", "max_queue": 7})
    settings = settings_from_args(parse("--config", str(config_file)), environ={})
    assert settings.controls.block_size == 32 and settings.controls.enable_prefix_caching is False
    assert settings.controls.admission.on_late == "abort"
    flagged = settings_from_args(parse("--config", str(config_file), "--prefix-caching", "--on-late", "end_early"),
                                 environ={})
    assert flagged.controls.enable_prefix_caching is True and flagged.controls.admission.on_late == "end_early"
    assert flagged.controls.admission.max_queue == 7  # not given as a flag: the file's


def test_a_config_written_before_on_late_still_reads(tmp_path):
    config_file = descriptor_file(tmp_path, "config.json", admission={"policy": "deadline", "abort_late": True})
    assert settings_from_args(parse("--config", str(config_file)), environ={}).controls.admission.on_late == "abort"
    contradiction = descriptor_file(tmp_path, "bad.json", admission={"abort_late": True, "on_late": "end_early"})
    with pytest.raises(SettingsError, match="abort_late: true contradicts on_late: end_early"):
        settings_from_args(parse("--config", str(contradiction)), environ={})


def test_defaults_without_any_file():
    settings = settings_from_args(parse(), environ={})
    assert settings.controls == ServeSettings(admission={"policy": "deadline"})  # the serve profile, over the defaults
    assert settings.server.zmq_endpoint == "tcp://0.0.0.0:5555" and settings.server.http_port == 8080
    assert settings.server.drain_timeout_s == 25.0
    assert settings.server.curve is None and settings.engine_config().admission.policy == "deadline"


def test_engine_config_from_settings(tmp_path):
    settings = settings_from_args(parse("--kv-cache-budget", "8MiB", "--admission", "fcfs", "--safety-margin", "0.5",
                                      "--max-queue", "7", "--latency-fit", "fit.json", "--seed", "3"), environ={})
    config = settings.engine_config()
    assert config.kv_cache_budget == 8 << 20 and config.admission.policy == "fcfs"
    assert config.admission.safety_margin == 0.5 and config.admission.max_queue == 7
    assert config.latency_fit == "fit.json" and config.seed == 3


def test_curve_can_be_enabled_in_one_layer_and_keyed_in_another(tmp_path):
    config_file = descriptor_file(tmp_path, "config.json", curve={"enabled": True})
    settings = settings_from_args(parse("--config", str(config_file), "--curve-secret-key", "s.key_secret",
                                      "--curve-authorized-dir", "clients"), environ={})
    assert settings.server.curve == CurveOptions("s.key_secret", "clients")
    keyed = settings_from_args(parse("--curve-secret-key", "s.key_secret", "--curve-authorized-dir", "c"), environ={})
    assert keyed.controls.curve.enabled is True  # giving the keys turns it on
    with pytest.raises(SettingsError) as error:
        settings_from_args(parse("--config", str(config_file)), environ={})
    assert "curve.server_secret_key_file" in str(error.value)


# ------------------------------------------------------------------------------ errors

def test_flag_errors_name_the_field():
    with pytest.raises(SettingsError) as error:
        settings_from_args(parse("--block-size", "0"), environ={})
    assert "command-line flags: field 'block_size'" in str(error.value)
    with pytest.raises(SettingsError) as budget:
        settings_from_args(parse("--kv-cache-budget", "lots"), environ={})
    assert "field 'kv_cache_budget'" in str(budget.value) and "lots" in str(budget.value)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(SettingsError) as missing:
        settings_from_args(parse(), environ={"CONFIG_FILE": str(tmp_path / "absent.json")})
    assert "CONFIG_FILE=" in str(missing.value) and "absent.json" in str(missing.value)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(SettingsError) as not_json:
        settings_from_args(parse("--config", str(broken)), environ={})
    assert "not valid JSON" in str(not_json.value)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"block_size": 16}))
    with pytest.raises(SettingsError) as no_controls:
        settings_from_args(parse("--config", str(bare)), environ={})
    assert "no 'controls' object" in str(no_controls.value)


def test_serve_command_reports_bad_settings_and_exits_2(capsys, monkeypatch):
    from ricllm.cli import main

    monkeypatch.delenv("CONFIG_FILE", raising=False)
    assert main(["serve", "--block-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ricllm: error: command-line flags: field 'block_size'")

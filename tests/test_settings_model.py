"""One settings model: every engine setting is a flag of each engine command and a property of the
descriptor schema, without other edits; flags parse into the model's nested sections."""

from __future__ import annotations

import argparse

import pytest
from pydantic import BaseModel

from ricllm.cli import build_parser
from ricllm.cli.flags import add_settings_flags, given_settings
from ricllm.config import AdmissionSettings, EngineConfig, EngineSettings, setting


def leaf_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> set[str]:
    paths = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths |= leaf_paths(annotation, (*prefix, name))
        else:
            paths.add(".".join((*prefix, name)))
    return paths


def flag_paths(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest.removeprefix("setting:") for a in sub.choices[command]._actions if a.dest.startswith("setting:")}


@pytest.mark.parametrize("command, left_out", [("serve", set()), ("prepare", set()), ("generate", {"seed"})])
def test_every_engine_setting_is_a_flag(command, left_out):
    assert leaf_paths(EngineSettings) - left_out <= flag_paths(command)
    assert not leaf_paths(EngineSettings) & left_out & flag_paths(command)


def test_every_engine_setting_is_in_the_descriptor_schema():
    from ricllm.serve.descriptor import controls_schema

    def schema_paths(node: dict, prefix: tuple[str, ...] = ()) -> set[str]:
        paths = set()
        for name, sub in node["properties"].items():
            paths |= schema_paths(sub, (*prefix, name)) if "properties" in sub else {".".join((*prefix, name))}
        return paths

    assert leaf_paths(EngineSettings) <= schema_paths(controls_schema())


def test_a_new_setting_becomes_a_flag_that_parses_into_its_section():
    class WithNewSettings(EngineSettings):
        prefill_priority: int = setting(3, "a setting added to the model", ge=0)

    parser = argparse.ArgumentParser()
    add_settings_flags(parser, WithNewSettings, "engine")
    args = parser.parse_args(["--prefill-priority", "5", "--safety-margin", "0.3", "--no-prefix-caching"])
    given = given_settings(args)
    assert given == {"prefill_priority": 5, "enable_prefix_caching": False, "admission": {"safety_margin": 0.3}}
    assert WithNewSettings.model_validate(given).admission.safety_margin == 0.3
    assert "a setting added to the model (default: 3)" in " ".join(parser.format_help().split())


def test_only_typed_flags_are_given_and_defaults_come_from_the_model():
    args = build_parser().parse_args(["generate", "hi", "--admission", "deadline", "--kv-cache-budget", "8MiB"])
    assert given_settings(args) == {"admission": {"policy": "deadline"}, "kv_cache_budget": "8MiB"}
    config = EngineConfig(**given_settings(args))
    assert config.kv_cache_budget == 8 << 20 and config.admission.policy == "deadline"
    assert config.admission.safety_margin == AdmissionSettings().safety_margin and config.block_size == 16


def test_one_default_per_field_admission_is_off_in_the_model():
    assert EngineSettings().admission.policy == EngineConfig().admission.policy == "off"
    assert EngineConfig(admission="deadline").admission == AdmissionSettings(policy="deadline")


def test_the_scenario_engine_section_is_the_settings_model_partly_filled():
    from ricllm.replay.cli import engine_kwargs
    from ricllm.replay.loading import load_scenario
    from ricllm.replay.schema import Scenario

    assert Scenario.model_fields["engine"].annotation is EngineSettings
    scenario = load_scenario("default", ["engine.admission.safety_margin=0.2", "engine.max_packed_rows=8"])
    kwargs = engine_kwargs(scenario)
    assert kwargs["admission"]["policy"] == "deadline"  # the scenario profile: the model's default is off
    assert kwargs["admission"]["safety_margin"] == 0.2 and kwargs["max_packed_rows"] == 8
    assert "block_size" not in kwargs  # unset: the engine's own default
    assert EngineConfig(**kwargs).admission.tightest_deadline_ms == min(
        c.deadline_ms for c in scenario.classes.values() if c.deadline_ms is not None)


def test_merging_layers_never_changes_a_profile():
    from ricllm.config import merge_layers
    from ricllm.replay.schema import SCENARIO_PROFILE

    merged = merge_layers(SCENARIO_PROFILE, {"kv_cache_budget": "8MiB"})
    merged["admission"]["tightest_deadline_ms"] = 1.0
    assert SCENARIO_PROFILE == {"admission": {"policy": "deadline"}}

"""Settings and priorities each have one home, read from the sources with ``ast``.

- settings: every settings model (a class built on the strict settings base or on a settings
  model, or with a field made by ``setting(...)``) is defined in ``ricllm/config/``, as two
  input/resolved pairs; the config-file watcher holds no copy of its own;
- priorities: the scheduling classes are listed once, in ``ricllm/sampling_params.py``;
- the served model's name: the fallbacks from the ``served_model_name`` setting are taken once, in
  ``ricllm/model/identity.py`` (``tests/serve/test_model_identity.py`` checks every front reports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ricllm"
CONFIG = PACKAGE / "config"
PRIORITY_NAMES = {"near_rt", "non_rt", "best_effort"}


def sources() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(PACKAGE.rglob("*.py"))]


def base_names(node: ast.ClassDef) -> set[str]:
    return {base.id if isinstance(base, ast.Name) else base.attr for base in node.bases
            if isinstance(base, (ast.Name, ast.Attribute))}


def calls_setting(node: ast.ClassDef) -> bool:
    return any(isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "setting"
               for call in ast.walk(node))


def settings_models() -> dict[str, Path]:
    """Every class that is a settings model, by name -> the file defining it: those whose field is
    a ``setting(...)``, and (to a fixed point) those built on one or on ``StrictModel``."""
    classes = [(node, path) for path, tree in sources() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    models = {node.name: path for node, path in classes if calls_setting(node) or node.name == "StrictModel"}
    while True:
        more = {node.name: path for node, path in classes
                if node.name not in models and base_names(node) & set(models)}
        if not more:
            return models
        models.update(more)


def test_every_settings_model_is_defined_in_the_config_package():
    models = settings_models()
    assert {"EngineSettings", "EngineConfig", "ServeSettings"} <= set(models)
    elsewhere = {name: str(path.relative_to(ROOT)) for name, path in models.items() if CONFIG not in path.parents}
    assert not elsewhere, f"settings models outside ricllm/config/: {elsewhere}"


def test_settings_come_as_two_input_resolved_pairs():
    from ricllm.config import EngineConfig, EngineSettings, ServeConfig, ServeSettings, resolve_settings

    assert issubclass(EngineConfig, EngineSettings) and issubclass(ServeSettings, EngineSettings)
    resolved = resolve_settings({"kv_cache_budget": "8MiB", "admission": {"max_queue": 3}}, environ={})
    assert isinstance(resolved, ServeConfig) and isinstance(resolved.controls, ServeSettings)
    engine = resolved.engine_config()
    assert isinstance(engine, EngineConfig)
    assert engine.kv_cache_budget == 8 << 20 and engine.admission.max_queue == 3  # resolved: bytes
    assert engine.admission.policy == "deadline"  # the serve profile reaches the engine's part


def test_the_config_watcher_keeps_the_resolved_serve_config_not_a_copy():
    """``serve/reload.py`` defines no class that holds settings values of its own: what it publishes
    for ``GET /ric/v1/config`` is a ``ServeConfig``."""
    tree = ast.parse((PACKAGE / "serve" / "reload.py").read_text())
    fields = {target.id for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
              for statement in node.body if isinstance(statement, ast.AnnAssign)
              for target in [statement.target] if isinstance(target, ast.Name)}
    assert not fields & {"controls", "sources", "config_file", "reloads"}, fields


def priority_lists() -> list[str]:
    """Every place in ricllm/ that spells out two or more priority names together: a tuple, list or
    set of strings, or a ``Literal[...]``."""
    found = []
    for path, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(names & PRIORITY_NAMES) >= 2:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_priorities_are_listed_once():
    assert priority_lists() == [f"ricllm/sampling_params.py:{_priority_line()}"]


def _priority_line() -> int:
    for number, line in enumerate((PACKAGE / "sampling_params.py").read_text().splitlines(), 1):
        if line.startswith("Priority = Literal["):
            return number
    raise AssertionError("ricllm/sampling_params.py defines no Priority literal")


def test_every_front_reads_the_one_priority_list(capsys):
    from ricllm import protocol
    from ricllm.cli import build_parser
    from ricllm.replay.schema import DeadlineClass
    from ricllm.sampling_params import PRIORITIES, Priority

    assert PRIORITIES == ("near_rt", "non_rt", "best_effort")
    assert protocol.Priority is Priority
    assert protocol.GenerateRequest.model_fields["priority"].annotation == Priority | None
    assert DeadlineClass.model_fields["priority"].annotation == Priority | None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["client", "generate", "hello", "--priority", "urgent"])
    error = capsys.readouterr().err
    assert "invalid choice: 'urgent'" in error and all(name in error.split("choose from")[1] for name in PRIORITIES)


def test_the_served_name_is_derived_once():
    derived = [f"{path.relative_to(ROOT)}:{node.lineno}" for path, tree in sources() for node in ast.walk(tree)
               if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or)
               and any(isinstance(v, (ast.Name, ast.Attribute)) and (getattr(v, "id", None) or v.attr)
                       == "served_model_name" for v in node.values)]
    assert derived == [f"ricllm/model/identity.py:{_line_of(PACKAGE / 'model' / 'identity.py', 'served_model_name or')}"]


def _line_of(path: Path, text: str) -> int:
    return next(number for number, line in enumerate(path.read_text().splitlines(), 1) if text in line)

"""The LoRA adapters a scenario's templates are served under: found, or trained on first use.

A template's ``adapter`` (``AdapterSpec``) is a PEFT folder, or a recipe: ``ricllm adapt``'s options
for that template. A recipe's adapter is trained once, in a child process (training imports torch
and ``peft``: the ``[adapt]`` extra; the replay's own process may run the native runtime, without
torch), into the cache under a key of everything it depends on: the scenario's template as stated
(``template_digest``), the recipe, and the base model file's digest. A later replay finds it there.

Either way the adapter's manifest (``ricllm_adapt.json``) must name this template and this base
model, or the replay stops with both digests: an adapter trained for other text or another model
answers a policy it was not taught. Under its adapter a template pins the adapter's short system
prompt (the one it was trained under), not the template's own conversation.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ricllm.errors import RicllmError
from ricllm.paths import cache_dir, file_digest
from ricllm.replay.adapt import template_digest, template_policy
from ricllm.replay.schema import Scenario, TemplateSpec
from ricllm.replay.templates import build_template
from ricllm.template import Template

MANIFEST = "ricllm_adapt.json"


class AdapterMismatchError(RicllmError, ValueError):
    """An adapter folder that was not made for this template or this base model."""


@dataclass(frozen=True)
class TemplateAdapter:
    """The adapter a template is served under, by the template's name."""

    name: str
    folder: Path
    system_prompt: str
    trained_now: bool

    def template(self, entry: TemplateSpec, base_dir: Path) -> Template:
        """The template as pinned under its adapter: the adapter's system prompt, the constraint and
        the fallback."""
        constraint = build_template(entry, base_dir).structured
        return Template.build(self.system_prompt, constraint, self.name, entry.min_confidence, entry.fallback)


def scenario_adapters(scenario: Scenario, model_path: Path, progress: bool = True) -> dict[str, TemplateAdapter]:
    """Every template with an ``adapter``, found or trained now; ``{}`` when none has one."""
    found = {}
    for name, entry in scenario.prompts.templates.items():
        if isinstance(entry, TemplateSpec) and entry.adapter is not None:
            found[name] = _template_adapter(scenario, name, entry, model_path, progress)
    return found


def _template_adapter(scenario: Scenario, name: str, entry: TemplateSpec, model_path: Path,
                      progress: bool) -> TemplateAdapter:
    digest = template_digest(scenario, template_policy(scenario, name))
    base = file_digest(model_path)
    if entry.adapter.path is not None:
        folder = Path(scenario.resolve_path(entry.adapter.path))
        trained = False
    else:
        folder = recipe_folder(scenario.name, name, digest, entry.adapter.recipe, base)
        trained = not (folder / MANIFEST).is_file()
        if trained:
            train(scenario, name, entry.adapter.recipe, model_path, folder, progress)
    manifest = read_manifest(folder)
    check_made_for(manifest, folder, name, digest, base)
    return TemplateAdapter(name, folder, manifest["system_prompt"], trained)


def recipe_folder(scenario: str, template: str, digest: str, recipe: dict, base: str) -> Path:
    """Where a recipe's adapter lives in the cache: a key over all it depends on."""
    key = hashlib.sha256(json.dumps({"template": digest, "recipe": recipe, "base": base},
                                    sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "adapters" / f"{scenario}-{template}-{key}"


def train(scenario: Scenario, template: str, recipe: dict, model_path: Path, folder: Path, progress: bool) -> None:
    """``ricllm adapt`` for the template, in a child process, its progress and judgement shown."""
    print(f"adapter for template {template!r}: none cached, training it now with ricllm adapt "
          f"({folder}); later replays reuse it", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "ricllm.cli", "adapt", str(scenario.path), "--template", template,
               "--model", str(model_path), "--out", str(folder), *recipe_flags(recipe)]
    if not progress:
        command.append("--no-progress")
    code = _relay(command)
    if code != 0:
        raise AdapterMismatchError(f"training the adapter of template {template!r} failed (ricllm adapt exited "
                                   f"{code}; its message is above)")


def _relay(command: list[str]) -> int:
    """Run ``command``, its output (progress bars included) passed on to this process's stderr as it comes."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as child:
        while chunk := child.stdout.read1(4096):
            sys.stderr.write(chunk.decode(errors="replace"))
            sys.stderr.flush()
    return child.returncode


def recipe_flags(recipe: dict) -> list[str]:
    """A recipe's options as ``ricllm adapt`` flags: ``{steps: 100, eval_examples: 50}`` → ``--steps 100
    --eval-examples 50``; ``true`` is a bare flag."""
    flags = []
    for option, value in sorted(recipe.items()):
        flag = "--" + option.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise AdapterMismatchError(f"adapter folder {folder} has no {MANIFEST}: ricllm adapt writes it, and the "
                                   "replay reads the template and base model it was made for from it")
    return json.loads(path.read_text(encoding="utf-8"))


def check_made_for(manifest: dict, folder: Path, template: str, digest: str, base: str) -> None:
    """Stop when ``folder``'s adapter was made for another template text or another base model."""
    made_for, made_on = manifest.get("template_sha256"), manifest.get("base_model", {}).get("sha256")
    if made_for != digest:
        raise AdapterMismatchError(f"adapter {folder} was trained for template text sha256 {made_for}; template "
                                   f"{template!r} here is {digest}: train it again (ricllm adapt)")
    if made_on != base:
        raise AdapterMismatchError(f"adapter {folder} was trained on base model sha256 {made_on}; this replay's "
                                   f"model is {base}: train it on this model (ricllm adapt --model)")

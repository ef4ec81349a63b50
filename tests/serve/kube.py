"""Kubernetes helpers for the packaging tests: kubectl's kustomize, and offline validation with
kubernetes-validate (both installed by ``bash scripts/setup.sh --dev``; skipped without them on a
user's machine, failed in CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.helpers import require, require_module

# kubernetes-validate ships schemas from 1.25 on; 1.30 is a release still in wide use, and every
# field deploy/ uses is older than 1.20 (the kubectl that renders it in CI).
KUBERNETES_VERSION = "1.30.0"


def kubectl() -> str:
    """$KUBECTL, else kubectl on PATH."""
    path = os.environ.get("KUBECTL") or shutil.which("kubectl")
    require(path is not None, "kubectl is not installed (scripts/setup.sh --dev installs Debian's kubernetes-client)")
    return path


def render_kustomization(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize DIRECTORY`` prints."""
    done = subprocess.run([kubectl(), "kustomize", str(directory)], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return [document for document in yaml.safe_load_all(done.stdout) if document]


def validation_errors(obj: dict[str, Any]) -> list[str]:
    """What the Kubernetes OpenAPI schema (strict: no unknown fields) finds wrong with ``obj``."""
    require_module("kubernetes_validate")
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(part) for part in exc.absolute_path)
        return [f"{obj['kind']} {obj['metadata'].get('name')}: {where}: {exc.message}"]
    return []

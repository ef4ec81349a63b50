"""The documentation's promises: a README a newcomer reads in five minutes, an architecture page
that names every package, docs written in the present tense, and links that lead somewhere."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

TEST_COMMAND = "bash scripts/setup.sh --dev && .venv/bin/python -m pytest"  # .ci/run runs exactly this
MAIN_JOB = "bash scripts/setup.sh && .venv/bin/ricllm replay default"

# Phrases that tell the project's history instead of what is (benchmarks/RESULTS.md, the dated
# log, is not checked).
HISTORY = [
    r"\bissues? #?\d+",
    r"\bas before\b",
    r"\bused to\b",
    r"\bno longer\b",
    r"\bpreviously\b",
    r"\bformerly\b",
    r"\bwas \d",
    r"\bbefore that\b",
    r"\bsince session\b",
    r"\bthis session\b",
    r"\bnow (does|uses|runs|takes|has|gives|serves|holds|reads|keeps)\b",
    r"\buntil (it|its) [a-z]+ (started|became|was)\b",
]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [target for target in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_readme_reads_in_five_minutes():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines; move detail to docs/"
    wide = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 100]
    assert not wide, f"README.md lines over 100 characters (line, width): {wide}"


def test_readme_gives_the_two_commands_verbatim():
    text = README.read_text(encoding="utf-8")
    assert TEST_COMMAND in text
    assert MAIN_JOB in text
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


def test_readme_links_the_architecture_and_every_doc():
    text = README.read_text(encoding="utf-8")
    for doc in DOCS:
        assert f"(docs/{doc.name})" in text, f"README.md does not link docs/{doc.name}"
    assert "(benchmarks/RESULTS.md)" in text


def test_architecture_names_every_package():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    packages = sorted(p.parent.name for p in (ROOT / "ricllm").glob("*/__init__.py"))
    assert packages, "no packages found under ricllm/"
    missing = [name for name in packages if f"ricllm/{name}/" not in text]
    assert not missing, f"docs/architecture.md does not name ricllm/{missing}"
    for folder in ("kernels/", "scenarios/"):
        assert f"`{folder}`" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_history(page):
    found = [
        f"line {n}: {match.group(0)!r}"
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        for pattern in HISTORY
        for match in re.finditer(pattern, line, flags=re.I)
    ]
    assert not found, f"{page.name} tells history; write what is: {found}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in _relative_links(page):
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.name} links to files that do not exist: {broken}"


def test_link_check_sees_links():
    assert "docs/architecture.md" in _relative_links(README)
    assert "https://github.com/guidance-ai/llguidance" not in _relative_links(ROOT / "docs" / "decisions.md")

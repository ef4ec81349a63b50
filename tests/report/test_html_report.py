"""report.html and the comparison page from a synthetic report: self-contained, escaped, and
showing the numbers of its aggregates; plots are real PNGs; the terminal table fits them too."""

from __future__ import annotations

import io
from html.parser import HTMLParser

from ricllm.replay.decisions import AnswerCheck, judge
from ricllm.report import compare, write_report
from ricllm.report.aggregate import aggregate, evaluate_targets
from ricllm.report.html import comparison_rows
from ricllm.report.records import SCHEMA_VERSION, RequestRecord, records_to_json
from ricllm.structured.spec import StructuredSpec

ACTIONS = ["offload", "hold", "escalate"]
CHOICE = AnswerCheck(StructuredSpec.parse({"choice": ACTIONS}))


def answer_of(i: int, skill: int) -> str:
    """Request i's answer: the expected action when ``i % skill``, else the next action; every 5th is garbage."""
    if i % 5 == 4:
        return "<i>offload"
    return ACTIONS[i % 3] if i % skill else ACTIONS[(i + 1) % 3]


def synthetic_report(name: str = "synthetic", e2e: float = 0.2, cached: int = 64, skill: int | None = None) -> dict:
    """30 requests; with ``skill``, each asks template alpha for one of ACTIONS, expects ACTIONS[i % 3],
    and is judged (the higher the skill, the fewer wrong answers)."""
    records = []
    for i in range(30):
        cls = "near_rt" if i % 3 else "non_rt"
        r = RequestRecord(f"r{i}", f"cell{i % 3}", i * 0.5, i + 2, "every_row", cls, "alpha",
                          500.0 if cls == "near_rt" else 4000.0, 8, i * 0.25, sent_s=i * 0.25,
                          expected={"answer": ACTIONS[i % 3]} if skill else None)
        if i % 7 == 6:
            r.finish("rejected", admitted=False, rejection_code="DEADLINE_INFEASIBLE", rejection_message="late",
                     done_s=i * 0.25)
        else:
            r.finish("completed", admitted=True, server_e2e_s=e2e * (1 + i % 4), server_ttft_s=0.05,
                     client_e2e_s=e2e * (1 + i % 4) + 0.002, client_ttft_s=0.052, prompt_tokens=100,
                     cached_tokens=cached, output_tokens=8, done_s=i * 0.25 + e2e, finish_reason="stop",
                     text=answer_of(i, skill) if skill else "<b>hold</b>")
        judge(r, CHOICE if skill else None)
        records.append(r)
    aggregates = aggregate(records, 8.0, ["near_rt", "non_rt"], {"peak_kv_used_blocks": 20, "kv_num_blocks": 100,
                                                                  "peak_kv_fraction": 0.2})
    targets = evaluate_targets({"overall": ["met_of_admitted >= 0.9"]}, aggregates)
    return {
        "schema_version": SCHEMA_VERSION, "kind": "ricllm-replay", "ricllm_version": "0.1.0",
        "created_at": "2026-01-01T00:00:00+00:00",
        "scenario": {"name": name, "path": "x.yaml", "overrides": [], "templates": {"alpha": {"tokens": 70}},
                     "spec": {"classes": {"near_rt": {"deadline_ms": 500.0}, "non_rt": {"deadline_ms": 4000.0}},
                              "engine": {"kv_cache_budget": "2MiB"}}},
        "run": {"mode": "in_process", "endpoint": None, "speed": 2.0, "started_at": "x", "planned": 30, "sent": 30,
                "wall_s": 8.0, "arrival_span_s": 7.25, "interrupted": False},
        "engine": {"settings": {"kv_cache_budget": 2097152, "enable_prefix_caching": True, "admission": "deadline"}},
        "model": {"name": "tiny", "sha256": "ab" * 32}, "machine": {"cpu": "test cpu", "cores": 2},
        "trace": {"source": "<generated>", "rows": 30, "rows_replayed": 30, "entities": ["cell0", "cell1", "cell2"],
                  "duration_s": 14.5, "load_stats": {"rows_read": 30},
                  "series": {"signals": [{"name": "RRU.PrbTotDl", "threshold": 20.0}], "entities": {
                      f"cell{c}": {"t": [0.0, 7.0, 14.0], "RRU.PrbTotDl": [10.0, None, 30.0]} for c in range(3)}}},
        "aggregates": aggregates, "targets": targets, "compliant": all(t["passed"] for t in targets),
        "timeline": [{"t_s": t * 0.25, "kv_used_blocks": 10 + t % 5, "kv_num_blocks": 100, "kv_pinned_blocks": 5,
                      "running": t % 4, "waiting": 0, "step_ms_mean": 3.0} for t in range(32)],
        "requests": records_to_json(records),
    }


class Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.text, self.tags = [], []

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data) -> None:
        self.text.append(data)


def parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    return page


def test_report_page_is_self_contained_and_shows_the_aggregates(tmp_path):
    report = synthetic_report(name="<script>alert(1)</script>")
    paths = write_report(report, tmp_path)
    html = paths["html"].read_text()
    page = parse(html)
    assert "<script>" not in html and not any(tag == "script" for tag, _ in page.tags)
    assert all(attrs["src"].startswith("data:image/png;base64,") for tag, attrs in page.tags if tag == "img")
    assert not any(tag == "link" for tag, _ in page.tags)
    text = " ".join(page.text)
    overall = report["aggregates"]["overall"]
    for shown in (f"{overall['met_of_admitted'] * 100:.1f}%", f"{overall['goodput_rps']:.3f}/s",
                  f"{overall['p95_e2e_s'] * 1000:.1f} ms", "DEADLINE_INFEASIBLE", "<b>hold</b>", "test cpu"):
        assert shown in text, shown
    for name in ("latency_cdf", "timeline", "trace"):
        assert paths[name].read_bytes().startswith(b"\x89PNG")


def test_comparison_rows_and_page(tmp_path):
    a, b = synthetic_report("fast"), synthetic_report("slow", e2e=0.4, cached=0)
    rows = comparison_rows(a, b)
    by_metric = {(scope, label): rest for scope, label, *rest in rows}
    assert by_metric[("overall", "prefix-cache hit rate")] == ["64.0%", "0.0%", "-64.0 pp"]
    assert by_metric[("overall", "E2E p50")][2] == "+100.0%"
    write_report(a, tmp_path / "fast")
    write_report(b, tmp_path / "slow")
    html, _, labels = compare(tmp_path / "fast", tmp_path / "slow" / "report.json", tmp_path / "cmp")
    assert labels == ("fast", "slow")
    text = " ".join(parse(html.read_text()).text)
    assert "fast vs slow" in text and "-64.0 pp" in text and (tmp_path / "cmp" / "compare_cdf.png").is_file()


def test_terminal_summary_lists_classes_and_targets():
    from rich.console import Console

    from ricllm.report import print_summary

    buffer = io.StringIO()
    print_summary(synthetic_report(), Console(file=buffer, width=160))
    out = buffer.getvalue()
    assert "near_rt" in out and "overall" in out and "met_of_admitted >= 0.9" in out
    assert "DEADLINE_INFEASIBLE 4" in out


def test_report_page_shows_the_decisions(tmp_path):
    report = synthetic_report(skill=2)
    overall = report["aggregates"]["overall"]
    paths = write_report(report, tmp_path)
    page = parse(paths["html"].read_text())
    text = " ".join(page.text)
    for shown in ("valid % of answered", f"{overall['valid_of_answered'] * 100:.1f}%", "correct % of answered",
                  f"{overall['correct_of_answered'] * 100:.1f}%", "useful goodput (per s)",
                  f"{overall['useful_goodput_rps']:.3f}/s", "Decisions: expected vs answered", "alpha: answer",
                  "expected \\ answered", "<i>offload"):
        assert shown in text, shown
    assert paths["decisions"].read_bytes().startswith(b"\x89PNG")
    assert len([tag for tag, _ in page.tags if tag == "img"]) == 4
    # the overall matrix: one table row per expected action, its counts, and an invalid column
    matrix = overall["confusion"]["alpha"]["answer"]
    assert sum(sum(row.values()) for row in matrix.values()) == overall["answered"] == 26
    assert matrix["offload"]["invalid"] == sum(1 for i in range(30) if i % 7 != 6 and i % 3 == 1 and i % 5 == 4)
    cells = [row for row in _table_rows(paths["html"].read_text()) if row and row[0] == "offload"]
    assert cells[0] == ["offload", *(str(matrix["offload"].get(c, 0)) for c in ("escalate", "hold", "offload",
                                                                                 "invalid")),
                        str(sum(matrix["offload"].values()))]


def test_a_report_without_decisions_says_so(tmp_path):
    paths = write_report(synthetic_report(), tmp_path)
    assert "No template declares a reference policy" in paths["html"].read_text() and "decisions" not in paths


def test_comparison_shows_the_decision_metrics(tmp_path):
    a, b = synthetic_report("guessing", skill=2), synthetic_report("skilled", skill=10)
    by_metric = {(scope, label): rest for scope, label, *rest in comparison_rows(a, b)}
    correct_a, correct_b = (r["aggregates"]["overall"]["correct_of_answered"] for r in (a, b))
    assert correct_b > correct_a
    assert by_metric[("overall", "correct % of answered")] == [
        f"{correct_a * 100:.1f}%", f"{correct_b * 100:.1f}%", f"{(correct_b - correct_a) * 100:+.1f} pp"]
    assert by_metric[("overall", "valid % of answered")][2] == "+0.0 pp"
    assert ("near_rt", "useful goodput (per s)") in by_metric
    write_report(a, tmp_path / "guessing")
    write_report(b, tmp_path / "skilled")
    html, _, _ = compare(tmp_path / "guessing", tmp_path / "skilled", tmp_path / "cmp")
    assert f"{(correct_b - correct_a) * 100:+.1f} pp" in " ".join(parse(html.read_text()).text)


def test_terminal_summary_shows_valid_correct_and_useful_goodput_per_class():
    from rich.console import Console

    from ricllm.report import print_summary

    report = synthetic_report(skill=2)
    buffer = io.StringIO()
    print_summary(report, Console(file=buffer, width=160))
    out = buffer.getvalue()
    assert "valid % answ." in out and "correct % answ." in out and "useful goodput" in out
    for scope in ("near_rt", "non_rt", "overall"):
        summary = {**report["aggregates"]["classes"], "overall": report["aggregates"]["overall"]}[scope]
        line = next(line for line in out.splitlines() if f" {scope} " in line and "answ" not in line
                    and f"{summary['useful_goodput_rps']:.3f}/s" in line)
        assert f"{summary['valid_of_answered'] * 100:.1f}%" in line
        assert f"{summary['correct_of_answered'] * 100:.1f}%" in line


def _table_rows(html: str) -> list[list[str]]:
    """Each <tr>'s <td> texts."""
    rows: list[list[str]] = []

    class Rows(HTMLParser):
        in_cell = False

        def handle_starttag(self, tag, attrs) -> None:
            if tag == "tr":
                rows.append([])
            self.in_cell = tag == "td" or self.in_cell

        def handle_endtag(self, tag) -> None:
            self.in_cell = self.in_cell and tag != "td"

        def handle_data(self, data) -> None:
            if self.in_cell:
                rows[-1].append(data)

    Rows().feed(html)
    return rows

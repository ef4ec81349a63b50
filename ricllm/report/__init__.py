"""Replay reports: write report.json + report.html + PNG plots, re-render them, compare two runs.

``records`` (what a replay records, and report.json), ``targets`` (compliance targets) and
``aggregate`` (the metrics, and whether the targets hold) need nothing of replay, which writes
the records and imports them from here.

``ricllm report PATH`` re-renders the HTML and plots from a report.json alone, so a report can be
regenerated on another machine or after a ricllm upgrade; ``ricllm report A B`` writes a
side-by-side comparison (prefix caching on vs off, two KV budgets, ...). matplotlib and rich are
imported only when drawing. The plots are optional (the ``ricllm[report]`` extra brings matplotlib):
without matplotlib, report.json and report.html are written all the same, the page says in each
plot's place what to install, and a ``report_plots_skipped`` warning event says it on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path
from typing import Any

from ricllm.extras import install_hint
from ricllm.report.records import load_report, write_report_json

PLOT_FILES = {"latency_cdf": "latency_cdf.png", "timeline": "timeline.png", "trace": "trace.png",
              "decisions": "decisions.png"}


PLOTTING_PACKAGE = "matplotlib"


def plots_available(report_path: Path | None = None) -> bool:
    """Whether matplotlib imports; when it does not, a warning event says what to install."""
    try:
        importlib.import_module(PLOTTING_PACKAGE)  # the plots import it next anyway
    except ImportError:
        from ricllm.logging import get_logger

        get_logger("ricllm.report").warning(
            "report_plots_skipped", missing=PLOTTING_PACKAGE, install=install_hint("report"),
            report=str(report_path) if report_path else None,
            detail="report.json and the HTML are written; the HTML says where each plot would be")
        return False
    return True


def render_plots(report: dict[str, Any], directory: Path | None = None) -> dict[str, bytes]:
    """The plots (none without matplotlib); the confusion matrices only when some answer was judged
    against a reference policy."""
    if not plots_available(directory):
        return {}
    from ricllm.report import plots

    pngs = {"latency_cdf": plots.latency_cdf(report), "timeline": plots.timeline(report),
            "trace": plots.trace_kpis(report)}
    if report["aggregates"]["overall"].get("confusion"):
        pngs["decisions"] = plots.decisions(report)
    return pngs


def write_html(report: dict[str, Any], directory: Path) -> dict[str, Path]:
    """report.html and the PNGs beside it (the HTML embeds them too)."""
    from ricllm.report.html import render_report

    directory.mkdir(parents=True, exist_ok=True)
    pngs = render_plots(report, directory)
    paths = {}
    for key, png in pngs.items():
        paths[key] = directory / PLOT_FILES[key]
        paths[key].write_bytes(png)
    paths["html"] = directory / "report.html"
    paths["html"].write_text(render_report(report, pngs), encoding="utf-8")
    return paths


def write_report(report: dict[str, Any], directory: Path) -> dict[str, Path]:
    """report.json first (it is the record; the rest is drawn from it), then HTML and plots."""
    json_path = write_report_json(report, directory)
    return {"json": json_path, **write_html(report, directory)}


def print_summary(report: dict[str, Any], console=None) -> None:
    from ricllm.report.terminal import print_summary as show

    show(report, console)


def compare(path_a: str | Path, path_b: str | Path,
            out: Path | None = None) -> tuple[Path, list[list[str]], tuple[str, str]]:
    """Write the comparison page of two reports; returns its path, the table rows and the labels."""
    from ricllm.report import plots
    from ricllm.report.html import comparison_rows, render_comparison

    (a, file_a), (b, file_b) = load_report(path_a), load_report(path_b)
    labels = _labels(file_a, file_b)
    directory = out or Path("reports") / _safe(f"compare-{labels[0]}-vs-{labels[1]}")
    directory.mkdir(parents=True, exist_ok=True)
    pngs = ({"compare_cdf": plots.compare_cdf(a, b, labels), "compare_timeline": plots.compare_timeline(a, b, labels)}
            if plots_available(directory) else {})
    for key, png in pngs.items():
        (directory / f"{key}.png").write_bytes(png)
    html = directory / "comparison.html"
    html.write_text(render_comparison(a, b, labels, pngs), encoding="utf-8")
    return html, comparison_rows(a, b), labels


def _labels(file_a: Path, file_b: Path) -> tuple[str, str]:
    """The report folders' names, made distinct when they are not."""
    a, b = file_a.parent.name or "A", file_b.parent.name or "B"
    return (a, b) if a != b else (f"A:{a}", f"B:{b}")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.:-]+", "_", name).replace(":", "_")


def add_report_subparser(sub: argparse._SubParsersAction) -> None:
    """``ricllm report``: registered by ``ricllm.cli.build_parser``."""
    parser = sub.add_parser(
        "report", help="re-render a replay report, or compare two",
        description="With one PATH (a report.json or its folder): re-render report.html and the plots beside it "
                    "and print the summary. With two: write a side-by-side comparison page and print the "
                    "comparison table.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="report.json or a report folder (one or two)")
    parser.add_argument("--out", default=None, help="comparison folder (default: reports/compare-A-vs-B)")
    parser.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from ricllm.report.records import ReportError

    if len(args.paths) > 2:
        raise ReportError(f"give one report (to re-render) or two (to compare), not {len(args.paths)}")
    if len(args.paths) == 1:
        report, path = load_report(args.paths[0])
        paths = write_html(report, path.parent)
        print_summary(report)
        print(f"report: {paths['html']}")
        return 0
    from ricllm.report.terminal import print_comparison

    html, rows, labels = compare(args.paths[0], args.paths[1], Path(args.out) if args.out else None)
    print_comparison(rows, labels)
    print(f"comparison: {html}")
    return 0

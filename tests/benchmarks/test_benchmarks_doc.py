"""BENCHMARKS.md quotes committed results files, not earlier runs: every table row equals the JSON it links, every
committed Markdown report is the one its JSON renders to, and the run facts (time, commit, load) match."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.paths import REPO_ROOT

from omnivox.benchmarks import report

ROOT = REPO_ROOT
DOC = (ROOT / "BENCHMARKS.md").read_text()
RESULTS = ROOT / "benchmarks" / "results"


def sections() -> list[tuple[str, list[Path]]]:
    """(text, the results JSONs it links, the section's own first) for each section of BENCHMARKS.md split at `## `.
    A results file named only in backticks is not checked: every one must be a link."""
    out = []
    for text in re.split(r"^## ", DOC, flags=re.M)[1:]:
        links = list(dict.fromkeys(re.findall(r"\(benchmarks/results/([\w.-]+\.json)\)", text)))
        bare = set(re.findall(r"`benchmarks/results/([\w.-]+\.json)`(?!\])", text)) - set(links)
        assert not bare, f"link {sorted(bare)} so that this test checks it (section {text.splitlines()[0]!r})"
        out.append((text, [RESULTS / name for name in links]))
    return out


def tables(text: str) -> list[list[dict[str, str]]]:
    """Markdown tables in `text` as rows of {header: cell}."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| ") and i + 1 < len(lines) and re.match(r"^\|[-:|]+\|$", lines[i + 1]):
            header = [h.strip() for h in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, [c.strip() for c in row.strip("|").split("|")], strict=True)))
            found.append(rows)
    return found


def quoted_sections() -> list[tuple[str, Path]]:
    """(section, its first results file): the one its tables come from."""
    return [(text, paths[0]) for text, paths in sections() if paths]


def quoted_results() -> list[tuple[str, Path]]:
    """(section, results file) for every file a section links: each run's facts are quoted where it is linked."""
    return [(text, path) for text, paths in sections() for path in paths]


def flat(text: str) -> str:
    return " ".join(text.split())


def test_every_quoted_results_file_is_committed() -> None:
    assert quoted_results(), "BENCHMARKS.md links no results file"
    for _, path in quoted_results():
        assert path.is_file(), path


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_committed_markdown_report_is_rendered_from_its_json(path: Path) -> None:
    result = json.loads(path.read_text())
    markdown = path.with_suffix(".md")
    if "levels" in result and "workload" in result:  # an `omnivox bench` run
        assert markdown.read_text() == report.markdown_report(result) + "\n", f"{markdown} is from another run"


def test_tables_equal_the_json_they_link() -> None:
    from omnivox.benchmarks import speech

    columns = {header: (key, fmt) for header, key, fmt in report.COLUMNS}
    checked = 0
    for text, path in quoted_sections():
        result = json.loads(path.read_text())
        for rows in tables(text):
            if "system" in rows[0]:  # an `omnivox bench` table (possibly fewer columns than the report's)
                levels = {(level["system"], str(level["concurrency"])): level for level in result["levels"]}
                for row in rows:
                    if row["system"] not in {s for s, _ in levels}:
                        continue  # e.g. the targets table
                    level = levels[(row["system"], row["conc."])]
                    for header, cell in row.items():
                        key, fmt = columns[header]
                        assert cell == report._cell(fmt, level.get(key)), (path.name, row["system"], header)
                    checked += 1
            elif "streams" in rows[0]:  # the speech benchmark's table
                expected = tables(speech.format_table(result))  # one table, or before and after
                assert rows in expected, path.name
                checked += len(rows)
    assert checked >= 20


def test_run_facts_match_the_json() -> None:
    for text, path in quoted_results():
        text = flat(text)  # a figure may be wrapped across lines
        result = json.loads(path.read_text())
        if "started" in result:  # two early files (runner-staging, serve-exit) recorded no run facts at all
            started = result["started"].split()[1]  # HH:MM
            assert f"{started} UTC" in text, (path.name, started)
        if result.get("commit"):
            assert result["commit"].split("+")[0] in text, (path.name, result["commit"])
        if "load_average_at_start" in result:  # a run that recorded its load quotes it
            load = "{:.1f} / {:.1f} / {:.1f}".format(*result["load_average_at_start"])
            assert load in text, (path.name, load)
        if "load_avg_1m" in result:  # tp_control records the 1-minute figure only
            assert f"load {result['load_avg_1m']:.1f}" in text, (path.name, result["load_avg_1m"])


def test_limits_and_targets_are_the_jsons() -> None:
    """The floor, the roofs and the target ratios quoted are the ones the run computed (none adjusted by hand)."""
    for text, path in quoted_sections():
        text = flat(text)
        result = json.loads(path.read_text())
        floor = result.get("floor")
        if not floor:
            continue
        assert f"{floor['itl_floor_ms']:.1f} ms" in text, path.name
        assert f"{floor['bandwidth_gb_s']:.1f} GB/s" in text, path.name
        assert f"{result['matmul']['gflop_per_s']:.0f} GFLOP/s" in text, path.name
        assert f"{floor['decode_tps_ceiling']:.0f} tok/s" in text, path.name
        assert f"{floor['workload_tps_ceiling_no_cache']:.0f} tok/s" in text, path.name
        for target in result.get("targets") or []:
            if target["value"] is None:  # not measured in this run
                continue
            if "ms" in target["target"]:
                assert f"{target['value']:.0f} ms" in text, target
            else:
                assert f"{target['value']:.2f}x" in text, target

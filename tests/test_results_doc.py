"""docs/results.md's and README's measured tables are the benchmarks' JSON, rendered (benchmarks/render_results.py)."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import render_results  # noqa: E402


def test_every_rendered_block_agrees_with_its_json():
    diffs = render_results.check()
    assert not diffs, ("a rendered table differs from benchmarks/results/ (run python benchmarks/render_results.py "
                       "after re-running the benchmark; never edit a rendered block by hand):\n" + "".join(diffs))


def test_the_quality_tables_are_rendered_in_both_documents():
    assert "quality" in render_results.blocks_in((REPO / "docs" / "results.md").read_text())
    readme = (REPO / "README.md").read_text()
    assert "readme-quality" in render_results.blocks_in(readme)
    # README's table lies in its Results section
    section = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    assert "<!-- rendered: readme-quality -->" in section


def test_a_figure_changed_in_the_json_is_caught(monkeypatch):
    original = render_results.load

    def changed(name):
        document = copy.deepcopy(original(name))
        if name == "quality.json":
            row = document["cases"][1]["rows"][0]  # Mooncake at its smallest size: README shows it too
            row["token_hit_ratio"]["wa"] += 0.0100
        return document

    monkeypatch.setattr(render_results, "load", changed)
    diffs = render_results.check()
    assert len(diffs) == 2 and all("wa" in d or "|" in d for d in diffs)
    assert any("README.md" in d for d in diffs) and any("docs/results.md" in d for d in diffs)


def test_a_block_without_a_renderer_or_its_json_is_an_error(monkeypatch, tmp_path):
    with pytest.raises(render_results.RenderError, match="no renderer"):
        render_results.render_text("<!-- rendered: nothing-such -->\n<!-- /rendered -->\n")
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    with pytest.raises(render_results.RenderError, match="missing"):
        render_results.render_text("<!-- rendered: scheduler -->\nold\n<!-- /rendered -->\n")


RUN = {"commit": "abc1234", "uncommitted": [], "date": "2026-12-05",
       "machine": {"cores": 2, "processor": "a CPU", "memory_gib": 24, "gpu": "no GPU", "python": "3.11.7"},
       "load_average_at_start": 1.0, "command": "python benchmarks/bench_x.py"}


def test_the_scheduler_json_of_the_documented_shape_renders(monkeypatch, tmp_path):
    row = {"median_step_us": 110.0, "p99_step_us": 9000.0, "median_x_native": 1.21, "p99_x_native": 1.27,
           "added_us_per_block": 2.5, "max_kvprof_call_us": 812.0, "plugin_built_bytes_per_block": 95.7,
           "plugin_bytes_per_block": 103.1}
    report = {"pools": {"50000": {"native": {"median_step_us": 91.0, "p99_step_us": 7098.0}, "wa": row}},
              "configs": {}}
    (tmp_path / "scheduler.json").write_text(json.dumps({"runs": [{"run": RUN, "report": report}]}))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.render_block("scheduler")
    assert "commit abc1234" in " ".join(text.split()) and "Pool of 50,000 blocks" in text
    assert "| wa | 110 | 1.21 | 9,000 | 1.27 | 812 | 2.50 | 95.7 / 103.1 |" in text


def test_the_serve_json_of_the_documented_shape_renders(monkeypatch, tmp_path):
    configs = {"native": {"requests_per_s": 60.0, "output_tokens_per_s": 960.0, "ttft_p50_ms": 41.5,
                          "ttft_p99_ms": 900.0},
               "wa": {"requests_per_s": 59.4, "output_tokens_per_s": 950.4, "ttft_p50_ms": 42.0, "ttft_p99_ms": 918.0,
                      "throughput_x_native": 0.99, "ttft_p99_x_native": 1.02, "token_hit_ratio": 0.5123}}
    report = {"configs": configs, "blocks": 2048, "block_size": 32, "concurrency": 16, "seconds": 60.0, "rounds": 2}
    (tmp_path / "serve.json").write_text(json.dumps({"runs": [{"run": RUN, "report": report}]}))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.render_block("serve")
    assert "2,048 blocks of 32 tokens, 16 clients" in " ".join(text.split())
    assert "| native | 60.00 | 960 | 41.5 | 900.0 | 1.000 | 1.000 | - |" in text  # a run without hit ratios
    assert "| wa | 59.40 | 950 | 42.0 | 918.0 | 0.990 | 1.020 | 0.5123 |" in text


def test_the_free_queue_json_of_the_documented_shape_renders(monkeypatch, tmp_path):
    document = {"run": RUN, "per_block": {"4": {"8192": {"native": [49, 90], "lru": [81, 220], "wa": [147, 270]}}},
                "per_call": {"4": {"native": {"1": 0.3, "16": 0.9}, "wa": {"1": 3.6, "16": 6.3}}},
                "chain": {"blocks": 8000, "pool": 50000, "ns_per_block": {"free": 10.5, "evict": 62.4}},
                "caching": {"pool": 50000, "us_per_call": {"native": 1.02, "lru": 7.99, "wa": 7.77}}}
    (tmp_path / "free_queue.json").write_text(json.dumps(document))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.render_block("free-queue")
    assert "| 8,192 | 49 / 90 | 81 / 220 (1.7x / 2.4x) | 147 / 270 (3.0x / 3.0x) |" in text
    assert "| wa | 3.6 (12.0x) | 6.3 (7.0x) |" in text
    prose = " ".join(text.split())  # prose lines are folded
    assert "free 10.5, evict 62.4" in prose and "wa 7.77 (adds 6.75)" in prose


def test_the_live_json_of_the_documented_shape_renders(monkeypatch, tmp_path):
    report = {"prompt_blocks": 128, "block_size": 16, "vllm": "0.32.0+cpu", "load_average_at_start": 0.4,
              "in_process": {"requests": 19996, "per_step": 4, "step_python_ms": 0.5, "model_ms": 20.0,
                             "hooks_us": 12.94, "added_us": 20.12, "written": 19996,
                             "dropped": {"queue_full": 0, "disk": 0, "error": 0}, "events_dropped": 0.0},
              "stall": {"prompt_blocks": 8000, "requests": 20, "written": 20, "longest_recording_ms": 0.55,
                        "longest_alone_ms": 0.9, "over_1ms_recording": 0, "over_1ms_alone": 0},
              "serve": {"plain": [{"requests_per_s": 10.0, "ttft_mean_s": 0.1}, {"requests_per_s": 10.5,
                                                                                  "ttft_mean_s": 0.1}],
                        "record": [{"requests_per_s": 10.8, "ttft_mean_s": 0.1}], "record_x_plain": 1.054,
                        "plain_spread": 0.049, "server_commit": "abc1234"},
              "startup": [{"start": "first start (compiles)", "ready_s": 146.2, "warm_up_s": 93.0,
                           "first_request_s": 0.095, "next_median_s": 0.039},
                          {"start": "second start (cache)", "ready_s": 53.0, "warm_up_s": None,
                           "first_request_s": 0.075, "next_median_s": 0.038}],
              "targets": [{"target": "the live loop adds <= 20 us", "measured": "20.1 us", "met": False},
                          {"target": "no wait over 1 ms", "measured": "8 ms; not judged", "met": None}]}
    (tmp_path / "live.json").write_text(json.dumps({"runs": [{"run": RUN, "report": report}]}))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.render_block("live")
    prose = " ".join(text.split())
    assert "commit abc1234" in prose and "load average 0.4 at the start" in prose and "vLLM 0.32.0+cpu" in prose
    assert "| 12.9 us |" in text and "| 20.1 us |" in text and "| 19,996, 0; 0 |" in text
    assert "| 0.55 / 0.90 ms (0 / 0 pieces over 1 ms) |" in text
    assert "| 10.00, 10.50 / 10.80 (1.054x) |" in text
    assert "| 146 s / 93.0 s / 95 ms / 39 ms |" in text and "| 53 s / - / 75 ms / 38 ms |" in text
    assert "- **missed**: the live loop adds <= 20 us: 20.1 us" in text
    assert "- not judged: no wait over 1 ms: 8 ms; not judged" in text
    assert "The servers ran kvprof as committed at abc1234." in prose


def test_record_stores_provenance_and_no_machine_paths(monkeypatch, tmp_path):
    import io

    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    report = {"schema": "kvprof.results/1", "inputs": {"trace_path": "/somewhere/deep/a.jsonl", "hp": {"path": "/x/hp.json"}}}
    path = render_results.record("demo", "kvprof demo -o DIR --json", False, io.StringIO(json.dumps(report)))
    stored = json.loads(path.read_text())["runs"][0]
    assert stored["run"]["command"] == "kvprof demo -o DIR --json" and stored["run"]["machine"]["cores"] >= 1
    assert stored["report"]["inputs"] == {"trace_path": "a.jsonl", "hp": {"path": "hp.json"}}
    render_results.record("demo", "again", True, io.StringIO('INFO a log line\n{"pools": {}}\n'))
    runs = json.loads(path.read_text())["runs"]
    assert len(runs) == 2 and runs[1]["report"] == {"pools": {}}
    with pytest.raises(render_results.RenderError, match="no JSON"):
        render_results.record("demo", "again", True, io.StringIO("INFO only logs\n"))


def test_free_queue_runs_recorded_one_per_mode_render_in_turn(monkeypatch, tmp_path):
    runs = [{"run": RUN, "report": {"chain": {"blocks": 8000, "pool": 50000, "ns_per_block": {"free": 10.5}}}},
            {"run": {**RUN, "commit": "def5678"}, "report": {"caching": {"pool": 50000, "us_per_call":
                                                                          {"native": 1.02, "wa": 7.77}}}}]
    (tmp_path / "free_queue.json").write_text(json.dumps({"runs": runs}))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    prose = " ".join(render_results.render_block("free-queue").split())
    assert prose.index("commit abc1234") < prose.index("free 10.5") < prose.index("commit def5678") < prose.index(
        "wa 7.77 (adds 6.75)")


#: What a reference page must not hold: a machine's paths, checkouts named by variable.
MACHINE = re.compile(r"/tmp/|/work/|/home/|/root/|\$MAIN|\$BRANCH|NUMBA_CACHE_DIR=/")


@pytest.mark.parametrize("name", ["docs/results.md", "benchmarks/results"])
def test_no_machine_paths_or_checkouts_in_the_results(name):
    path = REPO / name
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix == ".json")
    assert files
    for file in files:
        found = MACHINE.findall(file.read_text())
        assert not found, f"{file.relative_to(REPO)} names a machine's paths or a checkout: {sorted(set(found))}"


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in markdown.splitlines() if line.startswith("#")}


def test_every_link_into_the_results_page_names_one_of_its_headings():
    anchors = _anchors((REPO / "docs" / "results.md").read_text())
    links = [(path, anchor) for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
             for anchor in re.findall(r"results\.md#([\w-]+)", path.read_text())]
    links += [(REPO / "docs" / "results.md", a) for a in re.findall(r"\]\(#([\w-]+)\)",
                                                                      (REPO / "docs" / "results.md").read_text())]
    assert len(links) > 10
    broken = [f"{path.relative_to(REPO)}: #{anchor}" for path, anchor in links if anchor not in anchors]
    assert not broken, f"links to no heading of docs/results.md: {broken}"

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
                "caching": {"pool": 50000, "us_per_call": {"native": 1.02, "lru": 7.99, "wa": 7.77}},
                "through_pool": {"pool": 50000, "blocks": 64, "ns_per_block": {"native": 680.0, "lru": 782.0, "wa": 884.0}}}
    (tmp_path / "free_queue.json").write_text(json.dumps(document))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.render_block("free-queue")
    assert "| 8,192 | 49 / 90 | 81 / 220 (1.7x / 2.4x) | 147 / 270 (3.0x / 3.0x) |" in text
    assert "| wa | 3.6 (12.0x) | 6.3 (7.0x) |" in text
    prose = " ".join(text.split())  # prose lines are folded
    assert "free 10.5, evict 62.4" in prose and "wa 7.77 (adds 6.75)" in prose
    assert "`get_new_blocks(64)` + `free_blocks` through the block pool, 50,000 cached blocks" in prose
    assert "native 680.0, lru 782.0 (1.15x), wa 884.0 (1.30x)." in prose


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


def test_the_shadows_json_of_the_documented_shape_renders(monkeypatch, tmp_path):
    rows = [{"trace": "weka", "capacity": 3000, "candidate": "lru", "real": 0.10, "own_shadow": 0.10,
             "in_others_runs": {"s3fifo": 0.104, "model": 0.099}},
            {"trace": "weka", "capacity": 3000, "candidate": "s3fifo", "real": 0.12, "own_shadow": 0.1201,
             "in_others_runs": {"lru": 0.1280, "model": 0.1195}}]
    (tmp_path / "shadows.json").write_text(json.dumps({"run": RUN, "rows": rows, "wall_s": 1.0}))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.render_block("shadows")
    # the own shadow's largest error; the largest elsewhere, whose shadow under which leader; mean; share within
    assert "| weka | 3,000 | 0.0001 | +0.0080 (s3fifo under lru) | 0.0034 | 75 % |" in text
    prose = " ".join(text.split())
    assert "- **missed**: every shadow within 0.005" in prose and "0.0080 at worst (weka, 3,000 blocks" in prose
    assert "75 % of 4 predictions within" in prose


def test_the_learned_json_of_the_documented_shape_renders(monkeypatch, tmp_path):
    hits = {"lru": 0.10, "s3fifo": 0.12, "wa": 0.132, "belady": 0.20}
    rows = [{"trace": "weka", "capacity": 3000, "token_hit_ratio": hits, "best_baseline": "s3fifo",
             "wa_learned": 0.136, "start": "segmented", "learned_shadow_led": False,
             "predictor": {"holdout_log_loss": 0.532, "holdout_base_log_loss": 0.508}},
            {"trace": "mooncake", "capacity": 1000, "token_hit_ratio": hits, "best_baseline": "s3fifo",
             "wa_learned": 0.128, "start": "first-turn", "learned_shadow_led": None, "predictor": None}]
    (tmp_path / "learned.json").write_text(json.dumps({"run": RUN, "mode": "compare", "rows": rows}))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.render_block("learned")
    assert "| weka | 3,000 | .1000 | .1200 (s3fifo) | .1320 | .1360 | +0.0040 | +15 % / +20 % | segmented | no | " \
           "0.532 (0.508) | .2000 |" in text
    assert "| mooncake | 1,000 | .1000 | .1200 (s3fifo) | .1320 | .1280 | -0.0040 | +15 % / +10 % | first-turn | " \
           "not trained | - | .2000 |" in text
    prose = " ".join(text.split())
    assert "+0.0040 at best (weka, 3,000 blocks) and -0.0040 at worst (mooncake, 1,000 blocks)" in prose
    assert "trained at 1 of 2 points" in prose and "led the tuning replay at 0 of them" in prose
    assert "below the base rate's at 0" in prose
    (tmp_path / "learned.json").write_text(json.dumps({"run": RUN, "mode": "ablation", "rows": []}))
    with pytest.raises(render_results.RenderError, match="--compare"):
        render_results.render_block("learned")


def test_the_profiler_json_renders_the_sharded_fit_beside_the_in_memory_one(monkeypatch, tmp_path):
    document = {"run": RUN, "trace": {"preset": "bailian-a", "hours": 2, "seed": 0, "requests": 43572,
                                      "block_ids": 6273782, "fit_block_ids": 2749272, "jsonl_mb": 55.6},
                "repeat": 3, "fit_best_wall_s": 3.8, "fit_peak_rss_mb": 695.0,
                "steps": {"read": {"wall_s": 0.72, "cpu_s": 0.72}}, "read_block_ids_per_s": 8.71e6, "tuning": None,
                "sharded": {"preset": "bailian-b", "seed": 0, "fits": [
                    {"hours": 1.0, "sharded": False, "requests": 86000, "block_accesses": 10_000_000,
                     "peak_rss_mb": 900.0, "cpu_s": 22.1, "wall_s": 23.0},
                    {"hours": 24.0, "sharded": True, "requests": 2068266, "block_accesses": 254_600_000,
                     "peak_rss_mb": 2785.0, "cpu_s": 297.9, "wall_s": 310.0}]}}
    (tmp_path / "profiler.json").write_text(json.dumps(document))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.render_block("profiler")
    assert ("| `kvprof fit --sharded --window :` of 24 h bailian-b seed 0 (2,068,266 requests, 254.6 M block ids) | "
            "peak RSS 2.72 GB, 310 s wall | < 4 GB: met |") in text
    assert "| 1.17 us against 2.21 us (0.53x) | <= 1.3x: met |" in text


def test_the_hints_json_of_the_documented_shape_renders(monkeypatch, tmp_path):
    def entry(scenario, base, hits, closed, budget=None):
        return {"scenario": scenario, "base": base, "budget_fraction": budget, "token_hit_ratio": hits,
                "gap_closed": closed}

    rows = [{"capacity": 1000, "token_hit_ratio": {"lru": 0.11, "s3fifo": 0.12, "belady": 0.31},
             "best_baseline": "s3fifo",
             "continues": {"lru": {"token_hit_ratio": 0.17, "gap_closed": 0.25},
                           "s3fifo": {"token_hit_ratio": 0.171, "gap_closed": 0.2545}},
             "hinted": {"perfect over lru": entry("perfect", "lru", 0.109, -0.074),
                        "perfect over s3fifo": entry("perfect", "s3fifo", 0.1104, -0.07),
                        "random, budget over lru": entry("random, budget", "lru", 0.1116, -0.06, 0.1),
                        "random, budget over s3fifo": entry("random, budget", "s3fifo", 0.1081, -0.08, 0.1)}},
            {"capacity": 8000, "token_hit_ratio": {"lru": 0.49, "s3fifo": 0.48, "belady": 0.66},
             "best_baseline": "lru",  # the best baseline is lru here: both rows read the runs over lru
             "continues": {"lru": {"token_hit_ratio": 0.57, "gap_closed": 0.47}},
             "hinted": {"perfect over lru": entry("perfect", "lru", 0.5697, 0.46),
                        "random, budget over lru": entry("random, budget", "lru", 0.3765, -0.71, 0.1)}}]
    document = {"run": RUN, "cases": [{"trace": "mooncake", "n_requests": 2507, "rows": rows}],
                "targets": [{"target": "perfect hints: at least the oracle's share", "met": False, "measured": "-7%"}]}
    (tmp_path / "hints.json").write_text(json.dumps(document))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.render_block("hints")
    assert "| hints | over | 1,000 | 8,000 |" in text
    assert "| best baseline |  | .1200 (s3fifo) | .4900 (lru) |" in text
    assert "| continuation oracle | best baseline | .1710 (+25 %) | .5700 (+47 %) |" in text
    assert "| perfect | lru | .1090 (-7 %) | .5697 (+46 %) |" in text
    assert "| random, budget (0.1 of the cache, per tag and in all) | best baseline | .1081 (-8 %) | .3765 (-71 %) |" in text
    assert "| belady |  | .3100 | .6600 |" in text
    assert "- **missed**: perfect hints: at least the oracle's share: -7%" in text


def test_the_stall_runs_render_as_the_worst_of_each_shape(monkeypatch, tmp_path):
    def report(traffic, call, less_gc, waits):
        row = {"median_step_us": 110.0, "median_x_native": 1.1 if call < 900 else 1.3, "max_kvprof_call_us": call,
               "max_kvprof_call_less_gc_us": less_gc, "max_kvprof_call_wall_us": call + 5,
               "call_pass_feed_waits": waits}
        return {"traffic": traffic, "pool": 200000,
                "pools": {"200000": {"native": {"median_step_us": 100.0}, "wa": row}}}

    runs = [{"run": {**RUN, "command": "bench_scheduler.py --traffic agent"},
             "report": report("agent", 800.0, 700.0, {"settle": [1, 0.1, 0.1]})},
            {"run": {**RUN, "command": "bench_scheduler.py --traffic agent"},
             "report": report("agent", 2500.0, 1100.0, {"settle": [2, 0.5, 0.3]})}]
    (tmp_path / "scheduler_stalls.json").write_text(json.dumps({"runs": runs}))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    text = render_results.render_block("scheduler-stalls")
    assert "2 runs, each of: `bench_scheduler.py --traffic agent`." in " ".join(text.split())
    assert "| agent | wa | 1.10-1.30 | 2,500 | 1,100 | 2,505 | 1 of 2 | 3, longest 0.30 ms |" in text

"""Render the measured tables of docs/results.md and README.md from the benchmarks' JSON.

    python benchmarks/render_results.py            # rewrite every rendered block in place
    python benchmarks/render_results.py --check    # exit 1, with a diff, where a block differs from its JSON
    CMD --json | python benchmarks/render_results.py record NAME --command "CMD" [--append]

A rendered block sits between two marker comments; the text around it is written by hand:

    <!-- rendered: quality -->
    ... (this script's output; edits here are overwritten) ...
    <!-- /rendered -->

Each block name has a renderer and the JSON file(s) under benchmarks/results/ it reads (BLOCKS
below). A figure is changed by re-running its benchmark with ``-o benchmarks/results/NAME.json``
and this script, never by hand; tests/test_results_doc.py fails when a block and its JSON disagree.

``record`` stores a benchmark's JSON that comes on standard output (bench_scheduler.py --json,
``kvprof demo --json``) as benchmarks/results/NAME.json, ``{"runs": [{"run": ..., "report": ...}]}``
with the provenance benchmarks/provenance.py gives (commit, machine, date; the command as given),
and every value of a key ending in ``path`` cut to its file name. ``--append`` adds a run to the
file's list (bench_scheduler.py's shapes: agent, mixed, memory at 500,000 blocks).

JSON shapes the renderers read (keys not named are ignored):

- quality.json: bench_quality.py -o (``run``, ``policies``, ``baselines``, ``cases[].rows[]``, ``targets``;
  with --sample also ``samples[]``, which the ``quality-samples`` block renders).
- windows.json: bench_windows.py -o (``run``, ``rows[]``).
- unseen.json: bench_quality.py --unseen -o (as quality.json, on the synthetic traces no rule was chosen on).
- points.json: points.py -o (``run``, ``runs.{before,after}``, ``rows[]``, ``summary.{before,after}``): the three
  above against an earlier run of them.
- profiler.json, sim.json, memory.json: bench_profiler.py / bench_sim.py / bench_memory.py -o; profiler.json's
  ``sharded`` (with --sharded-hours) is ``{"preset", "seed", "fits": [{"hours", "sharded", "requests",
  "block_accesses", "peak_rss_mb", "cpu_s", "wall_s"}]}``, one fit in memory and one --sharded.
- learned.json: bench_learned.py --compare -o (``run``, ``mode`` "compare", ``rows[]`` of ``trace``,
  ``capacity``, ``token_hit_ratio`` (lru, the baselines, wa, belady), ``best_baseline``, ``wa_learned``,
  ``start``, ``learned_shadow_led`` (null where no predictor was trained) and ``predictor`` (its quality, or null)).
- hints.json: bench_hints.py --json (``run``, ``cases[]`` of ``trace``, ``n_requests`` and ``rows[]``, one per size:
  ``capacity``, ``token_hit_ratio`` (the baselines, belady), ``best_baseline``, ``continues`` ({base:
  {"token_hit_ratio", "gap_closed"}}) and ``hinted`` ({label: {"scenario", "base", "budget_fraction",
  "token_hit_ratio", "gap_closed"}}, the same labels at every size); ``targets[]`` as quality.json's).
- shadows.json: bench_shadows.py -o (``run``, ``rows[]`` of ``trace``, ``capacity``, ``candidate``, ``real``,
  ``own_shadow`` and ``in_others_runs`` ({leader: the shadow's prediction in the run it led})).
- fleet.json, fleet-weka.json: bench_fleet.py -o (``run``, ``cases[].rows[]``; weka at more accesses).
- demo.json: ``record demo`` of ``kvprof demo --json``: ``runs[0].report`` a kvprof.results/1 document.
- scheduler.json: ``record scheduler --append`` of bench_scheduler.py --json, once per shape:
  ``runs[i].report`` is ``{"pools": {POOL: {CONFIG: row}}, "configs": {...}}`` where a row has
  ``median_step_us``, ``p99_step_us``, ``median_x_native``, ``p99_x_native``, ``added_us_per_block``,
  ``max_kvprof_call_us`` (absent with --no-call-pass), ``plugin_built_bytes_per_block`` and
  ``plugin_bytes_per_block``; one table per run.
- scheduler_stalls.json: ``record scheduler_stalls --append`` of bench_scheduler.py --json, several runs
  of each traffic shape (rendered as one table of the worst calls per shape and configuration).
- serve.json: ``record serve`` of bench_serve.py --json: ``runs[i].report`` is ``{"configs": {CONFIG:
  {"requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "throughput_x_native",
  "ttft_p99_x_native", "token_hit_ratio"}}, "blocks", "block_size", "concurrency", "seconds", "rounds"}``;
  one table per run.
- live.json: ``record live`` of bench_live.py --json: ``runs[i].report`` is ``{"prompt_blocks", "vllm",
  "load_average_at_start", "in_process": {"requests", "per_step", "step_python_ms", "model_ms", "hooks_us",
  "added_us", "written", "dropped", "events_dropped"}, "targets": [{"target", "measured", "met"}]}``, and
  where measured ``"stall": {"prompt_blocks", "requests", "longest_recording_ms", "longest_alone_ms",
  "over_1ms_recording", "over_1ms_alone"}``, ``"serve": {"plain": [{"requests_per_s"}], "record": [...],
  "record_x_plain", "server_commit"}``, ``"startup": [{"start", "server_commit", "ready_s", "warm_up_s",
  "first_request_s", "next_median_s"}]``; a target's ``met`` is true, false or null (not judged); one table per run.
- cold_start.json: bench_cold_start.py -o (``run``, ``serve[]`` of ``start``, ``health_s``, ``core_ready_s`` (null
  without kvprof), ``first_request_s``; ``compile[]`` of ``policy``, ``cpu_s``, ``wall_s``; ``first_runs[]`` of
  ``command``, ``cache`` (empty, filled), ``wall_s``, ``cpu_s``; ``targets``); any part may be absent.
  cold_start_runs.json: the same, of a run with --compare --demo only.
- free_queue.json: ``record free_queue --append`` of each mode's JSON, whose parts are
  ``{"per_block": {CLASSES: {BLOCKS: {QUEUE: [cycle_ns, remove_ns]}}}, "per_call": {CLASSES: {QUEUE: {N: us}}},
  "chain": {"blocks": K, "pool": P, "ns_per_block": {PHASE: ns}}, "caching": {"pool": P, "us_per_call":
  {"native": us, "lru": us, "wa": us}}, "through_pool": {"pool": P, "blocks": N, "ns_per_block": {"native": ns,
  "lru": ns, "wa": ns}}}`` (bench_free_queue.py's ``bench``, ``bench_calls``, ``bench_chain``, ``bench_caching``
  and ``bench_through_pool`` results; any part may be absent); or one such document with its ``run`` beside the parts.

``record`` reads the last line of standard input that is a JSON object when the whole is not one (a
library's log lines before it are skipped).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
#: The files that hold rendered blocks.
DOCUMENTS = (REPO / "docs" / "results.md", REPO / "README.md")
BLOCK = re.compile(r"(<!-- rendered: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /rendered -->)", re.S)

#: README's table: these cases' two smallest sizes, each trace named with what it is on its first row.
README_CASES = {"weka-agents-dev": "real agent sessions", "mooncake-synthetic": "Mooncake's published trace",
                "bailian-a seed 0": "synthetic", "bailian-b seed 0": "synthetic"}


class RenderError(Exception):
    """A block that cannot be rendered: an unknown name, or its JSON missing or malformed."""


def load(name: str) -> dict:
    path = RESULTS / name
    if not path.exists():
        raise RenderError(f"benchmarks/results/{name} is missing (its block cannot be rendered)")
    return json.loads(path.read_text())


# --- formatting -------------------------------------------------------------------------------------

def ratio(value: float | None) -> str:
    """A hit ratio as the tables give it: .1234."""
    if value is None:
        return "-"
    text = f"{value:.4f}"
    return text[1:] if text.startswith("0.") else text


def signed(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value * 100:+.{digits}f} %"


def count(value: float) -> str:
    return f"{value:,.0f}"


def machine(run: dict) -> str:
    m = run["machine"]
    memory = f", {m['memory_gib']:g} GiB" if m.get("memory_gib") else ""
    return f"{m['cores']} cores ({m['processor']}){memory}, {m['gpu']}, Python {m['python']}"


def provenance(run: dict | None, command: str | None = None) -> str:
    """One line: when, at which commit, on what machine, by which command."""
    return f"{measured(run)} Command: `{command or run['command']}`."


def measured(run: dict | None) -> str:
    """When, at which commit, on what machine (:func:`provenance` without the command)."""
    if not run:
        raise RenderError("the JSON has no `run` (benchmarks/provenance.py facts): re-run the benchmark")
    commit = f"commit {run['commit']}" if run.get("commit") else "an unknown commit"
    if run.get("uncommitted"):
        commit += " with uncommitted changes to " + ", ".join(f"`{p}`" for p in run["uncommitted"])
    load_average = run.get("load_average_at_start")
    load_text = f", load average {load_average:g} at the start" if load_average is not None else ""
    return f"Measured {run['date']} at {commit}, on {machine(run)}{load_text}."


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


# --- quality (bench_quality.py) ----------------------------------------------------------------------

def quality_rows(document: dict):
    for case in document["cases"]:
        for row in case["rows"]:
            yield case, row


def render_quality(document: dict) -> list[str]:
    policies = document["policies"]
    rows = []
    for case, row in quality_rows(document):
        hits = row["token_hit_ratio"]
        cells = [f"**{ratio(hits[p])}**" if p == row["best_baseline"] else ratio(hits[p]) for p in policies]
        rows.append([case["trace"], count(row["capacity"]), *cells, signed(row["wa_gain_over_best"]),
                     signed(row["wa_gap_closed"])])
    lines = [provenance(document.get("run")), "",
             *table(["trace", "GPU blocks", *policies, "wa vs best baseline", "wa's share of the gap to Belady"], rows),
             "", *target_lines(document["targets"])]
    return lines


def target_lines(targets: list[dict]) -> list[str]:
    """A benchmark's targets, each met or missed, with what was measured."""
    return ["Targets:", "", *(f"- {'met' if t['met'] else '**missed**'}: {t['target']}: {t['measured']}" for t in targets)]


def quality_summary(document: dict) -> str:
    gains = [row["wa_gain_over_best"] for _, row in quality_rows(document) if row["wa_gain_over_best"] is not None]
    closed = [row["wa_gap_closed"] for case, row in quality_rows(document)
              if row["wa_gap_closed"] is not None and not case["trace"].startswith("bailian")]
    worst = min(quality_rows(document), key=lambda item: item[1]["wa_gain_over_best"])
    return (f"Over the suite's {len(gains)} points `wa` is {signed(sum(gains) / len(gains))} against the best baseline "
            f"on average, {signed(max(gains))} at best and {signed(min(gains))} at worst ({worst[0]['trace']}, "
            f"{count(worst[1]['capacity'])} blocks); on the real traces it closes at most "
            f"{max(closed) * 100:.0f} % of the gap to Belady.")


def render_readme_quality(document: dict) -> list[str]:
    baselines = document["baselines"]
    listed = ", ".join(f"`{b}`" for b in baselines[:-1]) + f" and `{baselines[-1]}`"
    rows = []
    for case in document["cases"]:
        if case["trace"] not in README_CASES:
            continue
        for i, row in enumerate(case["rows"][:2]):
            hits, best = row["token_hit_ratio"], row["best_baseline"]
            name = f"{case['trace']} ({README_CASES[case['trace']]})" if i == 0 else case["trace"]
            rows.append([name, count(row["capacity"]), ratio(hits["lru"]), f"{ratio(hits[best])} ({best})",
                         ratio(hits["wa"]), ratio(hits["belady"])])
    run = document["run"]
    return [f"Token hit ratio at each trace's two smallest cache sizes (fit on the fit window, replayed on the "
            f"evaluation window; the best baseline is the best of {listed}), measured {run['date']} at commit "
            f"{run['commit']}:", "",
            *table(["trace", "GPU blocks", "lru", "best baseline", "wa", "belady"], rows), "",
            quality_summary(document)]


def render_quality_samples(document: dict) -> list[str]:
    samples = document.get("samples")
    if not samples:
        raise RenderError("quality.json holds no sampled replays: run bench_quality.py with --sample 0.1,0.01")
    rows = []
    for row in samples:
        if "refused" in row:
            said, _, advice = row["refused"].partition(": their rejections would be the estimate. ")
            advice = advice.split(", or replay")[0].replace("Sample at least", "sample at least")
            rows.append([row["trace"], f"{row['rate']:g}", f"refused: {said}" + (f"; {advice}" if advice else ""),
                         "", "", "", ""])
            continue
        worst = max(row["errors"], key=lambda k: abs(row["errors"][k]))
        rows.append([row["trace"], f"{row['rate']:g}", f"{row['chains']:,} of {row['of_chains']:,}",
                     f"{row['max_abs_error']:.3f}".lstrip("0"), f"{worst.split()[0]} at {int(worst.split()[1]):,}",
                     f"{row['within_bound']} of {len(row['errors'])}", f"{row['speed_up']:.1f}x"])
    eligible = [r for r in samples if r["rate"] == 0.1 and r.get("chains", 0) >= 1000]
    met = bool(eligible) and all(r["max_abs_error"] <= 0.01 for r in eligible)
    return [*table(["trace", "sample", "conversations in it", "worst abs error", "policy at blocks",
                    "within the 2-SE bound", "sweep speed-up"], rows), "",
            f"- {'met' if met else '**missed**'}: error <= 0.01 at 0.1 wherever the sample holds >= 1,000 "
            "conversations: " + (", ".join(f"{r['trace']} {r['max_abs_error']:.3f}" for r in eligible) or "no such trace")]


# --- other splits of the real traces (bench_windows.py) --------------------------------------------------

def render_windows(document: dict) -> list[str]:
    rows = [[r["trace"], f"{r['fit'][0]:g}-{r['fit'][1]:g}", count(r["capacity"]),
             f"{ratio(r['best'])} ({r['best_baseline']})", ratio(r["wa"]), ratio(r["belady"]),
             signed(r["wa_gain_over_best"]), signed(r["wa_gap_closed"], 0)] for r in document["rows"]]
    gains = [r["wa_gain_over_best"] for r in document["rows"]]
    return [provenance(document.get("run")), "",
            *table(["trace", "fit window (s)", "GPU blocks", "best baseline", "wa", "belady", "wa vs best baseline",
                    "wa's share of the gap to Belady"], rows), "",
            f"Over these {len(gains)} points `wa` is {signed(sum(gains) / len(gains))} against the best baseline on "
            f"average, {signed(min(gains))} at worst."]



def render_points(document: dict) -> list[str]:
    rows = [[r["set"], r["trace"], f"{r['fit'][0]:g}-{r['fit'][1]:g}", count(r["capacity"]),
             r["after_best_baseline"], signed(r["gain_before"]), signed(r["gain_after"])] for r in document["rows"]]
    sides = []
    for side, runs in document["runs"].items():
        commits = sorted({run["commit"] for run in runs.values() if run and run.get("commit")})
        figures = document["summary"][side]
        sides.append(f"- {side} ({', '.join(commits)}): worst {signed(figures['worst'])}, {figures['below_1_percent']} of "
                     f"{figures['points']} points more than 1 % below the best baseline, mean {signed(figures['mean'], 2)}; "
                     f"at the real traces' two smallest sizes (every split) {signed(figures['mean_real_smallest'], 2)} on average")
    return [provenance(document.get("run")), "",
            *table(["set", "trace", "fit window (s)", "GPU blocks", "best baseline (after)", "wa vs best, before",
                    "wa vs best, after"], rows), "", *sides]

# --- the demo (kvprof demo --json, recorded) ------------------------------------------------------------

def render_demo(document: dict) -> list[str]:
    record = document["runs"][-1]
    report = record["report"]
    hits = {(r["policy"], r["capacity"]): r for r in report["runs"]}
    policies, capacities = report["config"]["policies"], report["config"]["capacities"]
    rows = []
    for capacity in capacities:
        lru, wa, belady = (hits[p, capacity]["token_hit_ratio"] for p in ("lru", "wa", "belady"))
        gap = belady - lru
        rows.append([count(capacity), *(ratio(hits[p, capacity]["token_hit_ratio"]) for p in policies),
                     signed((wa - lru) / lru), "-" if gap <= 0 else f"{(wa - lru) / gap * 100:.1f} %",
                     f"{hits['lru', capacity]['qttft_p99_s']:.1f} / {hits['wa', capacity]['qttft_p99_s']:.1f}"])
    return [provenance(record["run"]), "",
            *table(["GPU blocks", *policies, "wa vs lru", "wa's share of the LRU-Belady gap",
                    "modelled QTTFT p99, lru / wa (s)"], rows)]


# --- profiler (bench_profiler.py) ---------------------------------------------------------------------------

def render_profiler(document: dict) -> list[str]:
    trace, steps = document["trace"], document["steps"]
    best = document["fit_best_wall_s"]
    rows = [["`kvprof fit` end to end (best of "
             f"{document['repeat']})", f"{best:.2f} s wall, peak RSS {document['fit_peak_rss_mb']:,.0f} MB",
             f"<= 5 s: {'met' if best <= 5 else '**missed**'}"],
            ["its steps in one child (wall / CPU)", ", ".join(f"{name} {s['wall_s']:.2f} / {s['cpu_s']:.2f} s"
                                                              for name, s in steps.items()), ""],
            ["reading", f"{document['read_block_ids_per_s'] / 1e6:.2f} M block ids/s",
             f">= 1 M ids/s: {'met' if document['read_block_ids_per_s'] >= 1e6 else '**missed**'}"]]
    if document.get("tuning"):
        t = document["tuning"]
        added = t["with_learned_s"] - t["without_s"]
        rows.append([f"`fit --capacity {t['capacities']}`: what the learned candidate adds to tuning",
                     f"{added:+.2f} s ({t['without_s']:.2f} s without, {t['with_learned_s']:.2f} s with)",
                     f"<= 2 s: {'met' if added <= 2 else '**missed**'}"])
    if document.get("sharded"):
        rows += _sharded_rows(document["sharded"])
    return [provenance(document.get("run")), "",
            f"Trace: {trace['hours']:g} h {trace['preset']} seed {trace['seed']}: {trace['requests']:,} requests, "
            f"{trace['block_ids']:,} block ids ({trace['jsonl_mb']:.1f} MB of JSONL); fit window 0:3600 "
            f"({trace['fit_block_ids']:,} block ids), held-out scores on hour two.", "",
            *table(["step", "measured", "target"], rows)]


def _sharded_rows(sharded: dict) -> list[list[str]]:
    """The sharded fit's rows: its peak RSS, and its CPU per block access against the in-memory fit's."""
    memory, spilled = (next(f for f in sharded["fits"] if f["sharded"] is on) for on in (False, True))

    def per_access(fit: dict) -> float:
        return fit["cpu_s"] / fit["block_accesses"] * 1e6

    x = per_access(spilled) / per_access(memory)
    return [[f"`kvprof fit --sharded --window :` of {spilled['hours']:g} h {sharded['preset']} seed {sharded['seed']} "
             f"({spilled['requests']:,} requests, {spilled['block_accesses'] / 1e6:,.1f} M block ids)",
             f"peak RSS {spilled['peak_rss_mb'] / 1024:.2f} GB, {spilled['wall_s']:,.0f} s wall",
             f"< 4 GB: {'met' if spilled['peak_rss_mb'] < 4096 else '**missed**'}"],
            [f"its CPU per block access, against `kvprof fit --window :` of the first {memory['hours']:g} h in memory "
             f"({memory['block_accesses'] / 1e6:,.1f} M block ids)",
             f"{per_access(spilled):.2f} us against {per_access(memory):.2f} us ({x:.2f}x)",
             f"<= 1.3x: {'met' if x <= 1.3 else '**missed**'}"]]


# --- simulator speed (bench_sim.py) ------------------------------------------------------------------------

def render_sim(document: dict) -> list[str]:
    trace, reference = document["trace"], document.get("libcachesim_lru")
    rows = []
    for name, row in document["kvprof"].items():
        target = document["targets"][name]["vs_libcachesim_at_least"]
        if reference:
            x = row["per_s"] / reference["per_s"]
            versus = f"{x:.2f}x", f">= {target:g}x: {'met' if x >= target else '**missed**'}"
        else:
            versus = "(libCacheSim not installed)", f">= {target:g}x"
        rows.append([f"kvprof `{name}`", f"{row['per_s'] / 1e6:.2f} M ({row['seconds']:.2f} s)",
                     ratio(row["block_hit_ratio"]), *versus])
    if reference:
        rows.append(["libCacheSim LRU (C)", f"{reference['per_s'] / 1e6:.2f} M ({reference['seconds']:.2f} s)",
                     ratio(1 - reference["miss_ratio"]), "1", ""])
    lines = [provenance(document.get("run")), "",
             f"{trace['hours']:g} h {trace['preset']} seed {trace['seed']}: {trace['accesses']:,} block accesses of "
             f"{trace['engine_block']} tokens, {document['capacity']:,} blocks.", "",
             *table(["simulator", "accesses/s", "block hit ratio", "vs libCacheSim LRU", "target"], rows)]
    scaled = document.get("scaling") or []
    if scaled:
        by = {(r["hours"], r["policy"]): r for r in scaled}
        hours = sorted({r["hours"] for r in scaled})
        policies = sorted({r["policy"] for r in scaled})
        grow = []
        for h in hours:
            grow.append([f"{h:g} h", *(f"{1e6 / by[h, p]['per_s']:.3f} us/access, peak RSS "
                                       f"{by[h, p]['peak_mb']:,.0f} MB" if (h, p) in by else "-" for p in policies)])
        lines += ["", "Growth with trace length (one child process per length and policy):", "",
                  *table(["trace", *policies], grow), ""]
        first, last = hours[0], hours[-1]
        for p in policies:
            if (first, p) in by and (last, p) in by:
                per_access = by[first, p]["per_s"] / by[last, p]["per_s"]
                memory = by[last, p]["peak_mb"] / by[first, p]["peak_mb"]
                lines.append(f"- `{p}`, {last:g} h vs {first:g} h: seconds per access {per_access:.2f}x "
                             f"(<= 1.2x: {'met' if per_access <= 1.2 else '**missed**'}), peak RSS {memory:.2f}x "
                             f"(<= 1.5x: {'met' if memory <= 1.5 else '**missed**'})")
    if document.get("demo"):
        demo = document["demo"]
        lines += ["", f"`kvprof demo`'s work: {demo['total_s']:.1f} s in all (generate and read "
                      f"{demo['generate_and_read_s']:.1f} s, fit {demo['fit_s']:.1f} s, sweep {demo['sweep_s']:.1f} s)."]
    return lines


# --- memory against trace length (bench_memory.py) -----------------------------------------------------------

def render_memory(document: dict) -> list[str]:
    hours = document["hours"]
    first, last = hours[0], hours[-1]
    rows_by = {(r["policy"], r["hours"]): r for r in document["rows"] if "code" not in r}
    policies = list(dict.fromkeys(r["policy"] for r in document["rows"] if "code" not in r))
    rows = []
    for policy in policies:
        a, b = rows_by.get((policy, first)), rows_by.get((policy, last))
        if not (a and b):
            continue
        whole = b["peak_mb"] / a["peak_mb"]
        rows.append([f"`{policy}`", f"{a['peak_mb']:,.0f} -> {b['peak_mb']:,.0f} MB",
                     f"{whole:.2f}x ({'met' if whole <= document['target_whole_peak_ratio'] else '**missed**'})",
                     f"{a['trace_mb']:,.1f} -> {b['trace_mb']:,.1f} MB",
                     f"{a['replay_mb']:,.1f} -> {b['replay_mb']:,.1f} MB", f"{b['seconds']:.1f} s",
                     f"{ratio(a['hit_ratio'])} / {ratio(b['hit_ratio'])}"])
    return [provenance(document.get("run")), "",
            f"bailian-a seed 0, {first:g} h and {last:g} h, {document['capacity']:,} blocks of 16 tokens; target: "
            f"the whole peak at {last:g} h within {document['target_whole_peak_ratio']:g}x of {first:g} h's.", "",
            *table(["policy", "whole peak", f"{last:g} h / {first:g} h", "the trace's own arrays",
                    "the replay's own rise", f"replay at {last:g} h", "block hit ratio"], rows)]


# --- fleets (bench_fleet.py) -----------------------------------------------------------------------------

def _fleet_ratio(rows, router, n, policy, hp="fleet"):
    for row in rows:
        if row["router"] in (router, "single") and row["replicas"] == n and row["policy"] == policy and row["hp"] == hp:
            return row
    return None


def render_fleet(document: dict) -> list[str]:
    lines = [provenance(document.get("run"))]
    for case in document["cases"]:
        rows = case["rows"]
        policies = list(dict.fromkeys(r["policy"] for r in rows))
        routers = list(dict.fromkeys(r["router"] for r in rows if r["router"] != "single"))
        replicas = sorted({r["replicas"] for r in rows})
        body = []
        for n in replicas:
            for router in (["single"] if n == 1 else routers):
                found = {p: _fleet_ratio(rows, router, n, p) for p in policies}
                if not all(found.values()):
                    continue
                any_row = next(iter(found.values()))
                lru = found.get("lru")
                gain = (signed((found["wa"]["fleet_token_hit_ratio"] - lru["fleet_token_hit_ratio"])
                               / lru["fleet_token_hit_ratio"]) if "wa" in found and lru else "-")
                body.append([router, str(n), count(any_row["capacity"]),
                             *(ratio(found[p]["fleet_token_hit_ratio"]) for p in policies),
                             ratio((lru or any_row)["belady_token_hit_ratio"]), gain,
                             f"{lru['load_imbalance']:.2f}" if lru else "-"])
        per_replica = []
        for row in rows:
            if row["hp"] != "fleet" and row["policy"] == "wa":
                fleet = _fleet_ratio(rows, row["router"], row["replicas"], "wa")
                if fleet:
                    per_replica.append([row["router"], str(row["replicas"]), ratio(fleet["fleet_token_hit_ratio"]),
                                        ratio(row["fleet_token_hit_ratio"]),
                                        signed(row["fleet_token_hit_ratio"] / fleet["fleet_token_hit_ratio"] - 1)])
        lines += ["", f"**{case['trace']}**: {case['total_blocks']:,} blocks in all ({case['engine_block']}-token), "
                      f"{case['n_requests']:,} requests of the evaluation window.", "",
                  *table(["router", "replicas", "blocks each", *policies, "belady per replica, pooled (behind lru's routing)", "wa vs lru",
                          "imbalance (lru)"], body)]
        if per_replica:
            lines += ["", *table(["router", "replicas", "wa, one hp file", "wa, one hp file per replica",
                                  "per replica vs one"], per_replica)]
    return lines


# --- wa's shadows (bench_shadows.py) ----------------------------------------------------------------------------

def render_shadows(document: dict) -> list[str]:
    """Per trace and size: the own shadow's largest error, the largest in the runs other candidates led (and
    whose shadow, under which leader), the mean and the share within 0.005; then the target."""
    groups = {}
    for row in document["rows"]:
        groups.setdefault((row["trace"], row["capacity"]), []).append(row)
    body, errors, worst = [], [], None
    for (trace, capacity), rows in groups.items():
        own = max(abs(r["own_shadow"] - r["real"]) for r in rows)
        cross = [(v - r["real"], r["candidate"], leader, trace, capacity) for r in rows
                 for leader, v in r["in_others_runs"].items()]
        far = max(cross, key=lambda c: abs(c[0]))
        worst = far if worst is None or abs(far[0]) > abs(worst[0]) else worst
        errors += [abs(c[0]) for c in cross]
        body.append([trace, count(capacity), f"{own:.4f}", f"{far[0]:+.4f} ({far[1]} under {far[2]})",
                     f"{sum(abs(c[0]) for c in cross) / len(cross):.4f}",
                     f"{sum(abs(c[0]) <= 0.005 for c in cross) / len(cross) * 100:.0f} %"])
    within = sum(e <= 0.005 for e in errors) / len(errors)
    return [provenance(document.get("run")), "",
            *table(["trace", "GPU blocks", "own shadow: largest error",
                    "others' runs: largest error (shadow under leader)", "others' runs: mean error", "within 0.005"],
                   body), "",
            f"- {'met' if abs(worst[0]) <= 0.005 else '**missed**'}: every shadow within 0.005 of its candidate's real "
            f"token hit ratio in the runs the others led: {abs(worst[0]):.4f} at worst ({worst[3]}, {count(worst[4])} "
            f"blocks, {worst[1]} under {worst[2]}), mean {sum(errors) / len(errors):.4f}, {within * 100:.0f} % of "
            f"{len(errors):,} predictions within"]


# --- the learned candidate (bench_learned.py --compare) -----------------------------------------------------------

def render_learned(document: dict) -> list[str]:
    if document.get("mode") != "compare":
        raise RenderError("learned.json is not a bench_learned.py --compare run")
    body, moves, trained, below, led = [], [], 0, 0, 0
    for row in document["rows"]:
        hits, best = row["token_hit_ratio"], row["best_baseline"]
        gap = hits["belady"] - hits[best]
        quality = row.get("predictor") or {}
        if row["learned_shadow_led"] is not None:
            trained += 1
            led += row["learned_shadow_led"]
        held = "-"
        if "holdout_log_loss" in quality:
            below += quality["holdout_log_loss"] < quality["holdout_base_log_loss"]
            held = f"{quality['holdout_log_loss']:.3f} ({quality['holdout_base_log_loss']:.3f})"
        moves.append((row["wa_learned"] - hits["wa"], row["trace"], row["capacity"]))

        def closed(value: float) -> str:
            return f"{(value - hits[best]) / gap * 100:+.0f} %" if gap > 1e-9 else "-"

        body.append([row["trace"], count(row["capacity"]), ratio(hits["lru"]), f"{ratio(hits[best])} ({best})",
                     ratio(hits["wa"]), ratio(row["wa_learned"]), f"{row['wa_learned'] - hits['wa']:+.4f}",
                     f"{closed(hits['wa'])} / {closed(row['wa_learned'])}", row["start"] or "-",
                     {None: "not trained", True: "yes", False: "no"}[row["learned_shadow_led"]], held,
                     ratio(hits["belady"])])
    up, down = max(moves), min(moves)
    return [provenance(document.get("run")), "",
            *table(["trace", "GPU blocks", "lru", "best baseline", "wa", "wa with learned", "with learned - without",
                    "gap to Belady closed: wa / with learned", "tuned start (with learned)",
                    "learned shadow led the tuning replay", "predictor held-out log-loss (base rate's)", "belady"], body),
            "", f"With the learned candidate `wa` moves by {up[0]:+.4f} at best ({up[1]}, {count(up[2])} blocks) and "
                f"{down[0]:+.4f} at worst ({down[1]}, {count(down[2])} blocks). The predictor was trained at {trained} of "
                f"{len(moves)} points (tuning trains none where `wa` runs over `first-turn` and LRU, nor where Belady's "
                f"labels hold one class); its shadow led the tuning replay at {led} of them, and its held-out log-loss "
                f"is below the base rate's at {below}."]


# --- client hints (bench_hints.py --json) --------------------------------------------------------------------------

def render_hints(document: dict) -> list[str]:
    """Per trace: a row per hint scenario over LRU and over the size's best baseline, a column per size, each
    cell the token hit ratio and its share of the best-baseline-to-Belady gap; the best baseline, the
    continuation oracle and Belady beside them; then the targets."""
    lines = [provenance(document.get("run"))]
    for case in document["cases"]:
        rows, sizes = case["rows"], [count(row["capacity"]) for row in case["rows"]]
        scenarios = {entry["scenario"]: entry.get("budget_fraction") for entry in rows[0]["hinted"].values()}

        def cell(entry: dict) -> str:
            closed = entry.get("gap_closed")
            return ratio(entry["token_hit_ratio"]) + ("" if closed is None else f" ({closed * 100:+.0f} %)")

        def over(row: dict, base: str, scenario: str | None = None) -> str:
            """The entry over ``base`` (lru, or the size's best baseline): the oracle's, or the scenario's."""
            name = row["best_baseline"] if base == "best" else "lru"
            return cell(row["continues"][name] if scenario is None else row["hinted"][f"{scenario} over {name}"])

        body = [["best baseline", "", *(f"{ratio(r['token_hit_ratio'][r['best_baseline']])} ({r['best_baseline']})"
                                        for r in rows)]]
        for name, budget in {"continuation oracle": None, **scenarios}.items():
            scenario = None if name == "continuation oracle" else name
            shown = name + ("" if budget is None else f" ({budget:g} of the cache, per tag and in all)")
            body += [[shown, "lru" if base == "lru" else "best baseline", *(over(r, base, scenario) for r in rows)]
                     for base in ("lru", "best")]
        body.append(["belady", "", *(ratio(r["token_hit_ratio"]["belady"]) for r in rows)])
        split = (f", fit {case['fit_window'][0]:g}-{case['fit_window'][1]:g} s (another split)"
                 if case.get("other_split") else "")
        lines += ["", f"**{case['trace']}**{split}: {case['n_requests']:,} requests of the evaluation window; token hit "
                      "ratio (share of the best-baseline-to-Belady gap closed) at each size in GPU blocks.", "",
                  *table(["hints", "over", *sizes], body)]
    return [*lines, "", *target_lines(document["targets"])]


# --- the scheduler (bench_scheduler.py --json, recorded) ----------------------------------------------------

def render_scheduler(document: dict) -> list[str]:
    lines = []
    for record in document["runs"]:
        lines += ([""] if lines else []) + [provenance(record["run"]), ""]
        shape = record["report"].get("shape")
        for pool, configs in record["report"]["pools"].items():
            native = configs.get("native", {})
            totals = "total_s" in native  # the scheduler's total time, where the run gave it
            rows = []
            for name, row in configs.items():
                total = [f"{row['total_s']:.2f}", f"{row['total_s'] / native['total_s']:.2f}"] if totals else []
                if name == "native":
                    rows.append([name, f"{row['median_step_us']:,.0f}", "1.00", f"{row['p99_step_us']:,.0f}", "1.00",
                                 *total, "-", "-", "-"])
                    continue
                call = row.get("max_kvprof_call_us")
                rows.append([name, f"{row['median_step_us']:,.0f}", f"{row.get('median_x_native', 0):.2f}",
                             f"{row['p99_step_us']:,.0f}", f"{row.get('p99_x_native', 0):.2f}", *total,
                             "-" if call is None else f"{call:,.0f}",
                             f"{row.get('added_us_per_block', 0):.2f}",
                             f"{row.get('plugin_built_bytes_per_block', 0):.1f} / "
                             f"{row.get('plugin_bytes_per_block', 0):.1f}"])
            if lines and lines[-1]:  # a blank line ends the table before
                lines.append("")
            lines += [f"Pool of {int(pool):,} blocks" + (f", {shape}" if shape else "")
                      + (f" (native median {native['median_step_us']:,.0f} us)" if native else "") + ":", "",
                      *table(["config", "median step (us)", "x native", "p99 step (us)", "x native",
                              *(["total (s)", "x native"] if totals else []),
                              "longest kvprof call (us)", "added us per block", "plugin B/block, built / after traffic"],
                             rows)]
    return lines



def render_stalls(document: dict) -> list[str]:
    """Several runs of bench_scheduler.py per traffic shape, one row per shape and configuration: the
    longest kvprof call of any run (CPU, less the GC collections inside it, wall), the runs whose longest
    call less GC passed 1 ms, and the shadow feed's waits summed over the runs."""
    runs = document["runs"]
    shapes: dict[str, list[dict]] = {}
    for record in runs:
        shapes.setdefault(record["report"]["traffic"], []).append(record["report"])
    rows = []
    for shape, reports in shapes.items():
        configs = [name for name in reports[0]["pools"][str(reports[0]["pool"])] if name != "native"]
        for name in configs:
            by_run = [report["pools"][str(report["pool"])][name] for report in reports]
            medians = [row["median_x_native"] for row in by_run]
            waits = [wait for row in by_run for wait in (row.get("call_pass_feed_waits") or {}).values()]
            rows.append([shape, name, f"{min(medians):.2f}-{max(medians):.2f}",
                         f"{max(row['max_kvprof_call_us'] for row in by_run):,.0f}",
                         f"{max(row['max_kvprof_call_less_gc_us'] for row in by_run):,.0f}",
                         f"{max(row['max_kvprof_call_wall_us'] for row in by_run):,.0f}",
                         f"{sum(row['max_kvprof_call_less_gc_us'] > 1000 for row in by_run)} of {len(by_run)}",
                         f"{sum(w[0] for w in waits)}, longest {max((w[2] for w in waits), default=0):.2f} ms"])
    commands = list(dict.fromkeys(record["run"]["command"] for record in runs))
    each = "; ".join(f"`{command}`" for command in commands)
    return [f"{measured(runs[0]['run'])} {len(runs)} runs, each of: {each}.", "",
            *table(["traffic", "config", "median step x native (runs' range)", "longest kvprof call, CPU (us)",
                    "less GC inside it (us)", "wall (us)", "runs with a call over 1 ms less GC",
                    "shadow-feed waits (all runs)"], rows)]

# --- the free queue (bench_free_queue.py's results) ------------------------------------------------------------

def render_free_queue(document: dict) -> list[str]:
    """One part per run: ``record free_queue --append`` of each mode (per block and per call, --chain,
    --caching), or one document holding ``run`` and the parts."""
    if "runs" in document:
        lines = []
        for record in document["runs"]:
            lines += ([""] if lines else []) + render_free_queue({"run": record["run"], **record["report"]})
        return lines
    lines = [provenance(document.get("run"))]
    for classes, sizes in (document.get("per_block") or {}).items():
        rows = []
        queues = list(dict.fromkeys(q for by in sizes.values() for q in by))
        for blocks, by in sizes.items():
            native_cycle, native_remove = by["native"]
            rows.append([f"{int(blocks):,}", *(f"{by[q][0]:.0f} / {by[q][1]:.0f}"
                                               + ("" if q == "native" else
                                                  f" ({by[q][0] / native_cycle:.1f}x / {by[q][1] / native_remove:.1f}x)")
                                               for q in queues)])
        lines += ["", f"ns per block, popleft_n + append_n / remove on hit, {classes} classes:", "",
                  *table(["blocks", *queues], rows)]
    for classes, queues in (document.get("per_call") or {}).items():
        calls = list(next(iter(queues.values())))
        native = queues.get("native", {})
        rows = [[q, *(f"{by[n]:.1f}" + (f" ({by[n] / native[n]:.1f}x)" if q != "native" and native else "")
                      for n in calls)] for q, by in queues.items()]
        lines += ["", f"us per call (popleft_n(n) + append_n), {classes} classes:", "",
                  *table(["queue", *(f"n = {n}" for n in calls)], rows)]
    if document.get("chain"):
        chain = document["chain"]
        lines += ["", f"`wa`'s twin on a chain of {chain['blocks']:,} blocks in a pool of {chain['pool']:,}, ns per "
                      "block: " + ", ".join(f"{phase} {ns:.1f}" for phase, ns in chain["ns_per_block"].items()) + "."]
    if document.get("through_pool"):
        through = document["through_pool"]
        native = through["ns_per_block"]["native"]
        lines += ["", f"`get_new_blocks({through['blocks']:,})` + `free_blocks` through the block pool, "
                      f"{through['pool']:,} cached blocks, ns per block: " + ", ".join(
                          f"{kind} {ns:.1f}" + ("" if kind == "native" else f" ({ns / native:.2f}x)")
                          for kind, ns in through["ns_per_block"].items()) + "."]
    if document.get("caching"):
        caching = document["caching"]["us_per_call"]
        lines += ["", "`cache_full_blocks` of one block (a decode step), median us per call: " + ", ".join(
            f"{kind} {us:.2f}" + ("" if kind == "native" else f" (adds {us - caching['native']:.2f})")
            for kind, us in caching.items()) + "."]
    return lines


# --- serving end to end (bench_serve.py --json, recorded) ---------------------------------------------------

def render_serve(document: dict) -> list[str]:
    lines = []
    for record in document["runs"]:
        report = record["report"]
        rows = []
        for name, row in report["configs"].items():
            def ratio(key):
                value = row.get(key)
                return "1.000" if name == "native" else "-" if value is None else f"{value:.3f}"

            rows.append([name, f"{row['requests_per_s']:.2f}", f"{row['output_tokens_per_s']:,.0f}",
                         "-" if row["ttft_p50_ms"] is None else f"{row['ttft_p50_ms']:,.1f}",
                         "-" if row["ttft_p99_ms"] is None else f"{row['ttft_p99_ms']:,.1f}",
                         ratio("throughput_x_native"), ratio("ttft_p99_x_native"),
                         "-" if row.get("token_hit_ratio") is None else f"{row['token_hit_ratio']:.4f}"])
        lines += ([""] if lines else []) + [
            provenance(record["run"]), "",
            f"{report['blocks']:,} blocks of {report['block_size']} tokens, {report['concurrency']} clients, "
            f"{report['seconds']:g} s measured per run, best of {report['rounds']} round(s):", "",
            *table(["config", "requests/s", "output tokens/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
                    "throughput x native", "TTFT p99 x native", "token hit ratio"], rows)]
    return lines


# --- the live loop in vLLM (bench_live.py --json, recorded) -------------------------------------------------

def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"


def render_live(document: dict) -> list[str]:
    lines = []
    for record in document["runs"]:
        report = record["report"]
        run = {**record["run"], "load_average_at_start": report.get("load_average_at_start")}
        loop = report["in_process"]
        dropped = loop["dropped"]
        dropped = sum(dropped.values()) if isinstance(dropped, dict) else dropped
        rows = [[f"the hooks' own calls, median per request ({loop['requests']:,} requests of {report['prompt_blocks']} "
                 f"blocks, {loop['per_step']} scheduled and {loop['per_step']} finished per step of "
                 f"{loop['step_python_ms']:g} ms Python + {loop['model_ms']:g} ms model, `--kv-record` on)",
                 f"{loop['hooks_us']:.1f} us"],
                ["added to the scheduler's Python time per request (the hooks + the GIL the writer and "
                 "counterfactual threads hold)", f"{loop['added_us']:.1f} us"],
                ["the recorder: requests written, dropped; events dropped",
                 f"{loop['written']:,}, {dropped:,}; {loop['events_dropped'] or 0:,.0f}"]]
        if "stall" in report:
            stall = report["stall"]
            rows.append([f"a busy scheduler thread's longest wait while the recorder writes {stall['requests']} requests "
                         f"of {stall['prompt_blocks']:,} blocks / with no recorder",
                         f"{stall['longest_recording_ms']:.2f} / {stall['longest_alone_ms']:.2f} ms "
                         f"({stall['over_1ms_recording']} / {stall['over_1ms_alone']} pieces over 1 ms)"])
        if "serve" in report:
            serve = report["serve"]
            runs = {name: ", ".join(f"{r['requests_per_s']:.2f}" for r in serve[name]) for name in ("plain", "record")}
            rows.append(["`kvprof replay` against `vllm serve`, requests/s per run without / with `--kv-record`",
                         f"{runs['plain']} / {runs['record']} ({serve['record_x_plain']:.3f}x)"])
        for start in report.get("startup", []):
            warm = "-" if start["warm_up_s"] is None else f"{start['warm_up_s']:.1f} s"
            rows.append([f"{start['start']}: ready / kvprof's warm-up / first request / next ones",
                         f"{start['ready_s']:.0f} s / {warm} / {_ms(start['first_request_s'])} / "
                         f"{_ms(start['next_median_s'])}"])
        version = f" vLLM {report['vllm']}." if report.get("vllm") else ""
        servers = sorted({part["server_commit"] for part in [report.get("serve", {}), *report.get("startup", [])]
                          if part.get("server_commit")})
        if servers:
            version += f" The servers ran kvprof as committed at {', '.join(servers)}."
        verdict = {True: "met", False: "**missed**", None: "not judged"}
        lines += ([""] if lines else []) + [provenance(run) + version, "", *table(["what", "measured"], rows),
                                            "", "Targets:", ""]
        lines += [f"- {verdict[t['met']]}: {t['target']}: {t['measured']}" for t in report["targets"]]
    return lines


def render_cold_start(document: dict) -> list[str]:
    """bench_cold_start.py -o: start-up of `vllm serve`, each policy's compile, first runs on an empty cache."""
    rows = []
    for start in document.get("serve", []):
        core = "-" if start["core_ready_s"] is None else f"{start['core_ready_s']:.0f} s"
        rows.append([f"`vllm serve`, {start['start']}: /health / kvprof's core loaded / first request",
                     f"{start['health_s']:.0f} s / {core} / {_ms(start['first_request_s'])}"])
    for compiled in document.get("compile", []):
        rows.append([f"compile for `vllm serve` under `{compiled['policy']}`, empty cache (CPU / wall)",
                     f"{compiled['cpu_s']:.0f} s / {compiled['wall_s']:.0f} s"])
    runs = {}
    for run in document.get("first_runs", []):
        runs.setdefault(run["command"], {})[run["cache"]] = run
    for command, by_cache in runs.items():
        empty, filled = by_cache["empty"], by_cache["filled"]
        rows.append([f"`kvprof {command}`, empty cache / filled (wall; CPU with its workers)",
                     f"{empty['wall_s']:.0f} / {filled['wall_s']:.0f} s ({empty['wall_s'] / filled['wall_s']:.2f}x); "
                     f"{empty['cpu_s']:.0f} / {filled['cpu_s']:.0f} s"])
    verdict = {True: "met", False: "**missed**", None: "not judged"}
    return ([provenance(document["run"]), "", *table(["what", "measured"], rows), "", "Targets:", ""]
            + [f"- {verdict[t['met']]}: {t['target']}: {t['measured']}" for t in document["targets"]])


#: block name -> (the JSON file under benchmarks/results/, its renderer)
BLOCKS = {
    "quality": ("quality.json", render_quality),
    "readme-quality": ("quality.json", render_readme_quality),
    "quality-samples": ("quality.json", render_quality_samples),
    "windows": ("windows.json", render_windows),
    "unseen": ("unseen.json", render_quality),
    "points": ("points.json", render_points),
    "demo": ("demo.json", render_demo),
    "learned": ("learned.json", render_learned),
    "shadows": ("shadows.json", render_shadows),
    "profiler": ("profiler.json", render_profiler),
    "sim": ("sim.json", render_sim),
    "memory": ("memory.json", render_memory),
    "fleet": ("fleet.json", render_fleet),
    "fleet-weka": ("fleet-weka.json", render_fleet),
    "hints": ("hints.json", render_hints),
    "scheduler": ("scheduler.json", render_scheduler),
    "scheduler-stalls": ("scheduler_stalls.json", render_stalls),
    "scheduler-prefill": ("scheduler_prefill.json", render_scheduler),
    "free-queue": ("free_queue.json", render_free_queue),
    "serve": ("serve.json", render_serve),
    "live": ("live.json", render_live),
    "cold-start": ("cold_start.json", render_cold_start),
    "cold-start-runs": ("cold_start_runs.json", render_cold_start),
}


def wrapped(lines: list[str], width: int = 110) -> list[str]:
    """Prose lines folded at ``width`` (a list item's continuation indented); tables, blank lines and
    commands in backquotes are never broken."""
    out = []
    for line in lines:
        if line.startswith("|") or len(line) <= width:
            out.append(line)
            continue
        indent = "  " if line.startswith("- ") else ""
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
    return out


def render_block(name: str) -> str:
    if name not in BLOCKS:
        raise RenderError(f"no renderer for the block {name!r} (known: {', '.join(BLOCKS)})")
    source, renderer = BLOCKS[name]
    try:
        lines = wrapped(renderer(load(source)))
    except (KeyError, TypeError, IndexError, ValueError, ZeroDivisionError) as exc:
        raise RenderError(f"benchmarks/results/{source} does not have the shape the {name!r} block reads: "
                          f"{type(exc).__name__}: {exc}") from exc
    return "\n".join(lines) + "\n"


def render_text(text: str) -> str:
    """``text`` with every rendered block replaced by its renderer's output."""
    return BLOCK.sub(lambda m: m.group(1) + render_block(m.group("name")) + m.group(4), text)


def blocks_in(text: str) -> list[str]:
    return [m.group("name") for m in BLOCK.finditer(text)]


def check(documents=DOCUMENTS) -> list[str]:
    """A unified diff per document whose rendered blocks differ from their JSON (empty: all agree)."""
    diffs = []
    for path in documents:
        text = path.read_text()
        rendered = render_text(text)
        if rendered != text:
            name = str(path.relative_to(REPO))
            diffs.append("".join(difflib.unified_diff(text.splitlines(True), rendered.splitlines(True),
                                                      f"{name} (as committed)", f"{name} (rendered from JSON)")))
    return diffs


def _no_paths(value):
    """``value`` with every string under a key ending in ``path`` cut to its last component."""
    if isinstance(value, dict):
        return {k: (Path(v).name if isinstance(v, str) and k.endswith("path") else _no_paths(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [_no_paths(v) for v in value]
    return value


def _json_of(text: str):
    """``text`` as JSON, or the last of its lines that is a JSON object (log lines printed before it)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        for line in reversed(text.splitlines()):
            if line.lstrip().startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
    raise RenderError("no JSON object on standard input")


def record(name: str, command: str, append: bool, stream=sys.stdin) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from provenance import facts

    report = _no_paths(_json_of(stream.read()))
    run = facts([sys.argv[0]])
    run["command"] = command
    run["load_average_at_start"] = None  # taken after the benchmark ran: not its load
    path = RESULTS / f"{name}.json"
    runs = json.loads(path.read_text())["runs"] if append and path.exists() else []
    runs.append({"run": run, "report": report})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        parser = argparse.ArgumentParser(prog="render_results.py record", description="store a benchmark's JSON "
                                         "from standard input with its provenance")
        parser.add_argument("name", help="benchmarks/results/NAME.json")
        parser.add_argument("--command", required=True, help="the command that printed the JSON, as run from the "
                                                             "repository root (no machine paths)")
        parser.add_argument("--append", action="store_true", help="add a run to the file's list instead of replacing it")
        args = parser.parse_args(argv[1:])
        try:
            print(f"wrote {record(args.name, args.command, args.append)}", file=sys.stderr)
        except RenderError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a block differs from its JSON")
    args = parser.parse_args(argv)
    try:
        if args.check:
            diffs = check()
            sys.stdout.write("".join(diffs))
            if diffs:
                print("rendered blocks differ from benchmarks/results/: run python benchmarks/render_results.py",
                      file=sys.stderr)
            return 1 if diffs else 0
        for path in DOCUMENTS:
            text = path.read_text()
            rendered = render_text(text)
            if rendered != text:
                path.write_text(rendered)
                print(f"rendered {', '.join(blocks_in(text))} in {path.relative_to(REPO)}", file=sys.stderr)
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

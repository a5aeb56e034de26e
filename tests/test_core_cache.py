"""The compiled core's on-disk cache: stale entries are dropped when any core source is newer."""

from __future__ import annotations

import os

from kvprof.core import drop_stale_caches


def test_cache_files_older_than_the_newest_source_are_dropped(tmp_path):
    (tmp_path / "structs.py").write_text("")
    (tmp_path / "policies.py").write_text("")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    stale, fresh, other = cache / "policies.f-1.py311.nbi", cache / "policies.f-1.py311.1.nbc", cache / "policies.pyc"
    for path in (stale, fresh, other):
        path.write_text("")
    os.utime(tmp_path / "structs.py", (2000, 2000))  # the newest source
    os.utime(tmp_path / "policies.py", (1000, 1000))
    os.utime(stale, (1500, 1500))  # compiled before structs.py changed
    os.utime(fresh, (3000, 3000))
    os.utime(other, (1500, 1500))
    drop_stale_caches(tmp_path)
    assert not stale.exists() and fresh.exists() and other.exists()


def test_a_package_without_a_cache_directory_is_fine(tmp_path):
    (tmp_path / "engine.py").write_text("")
    drop_stale_caches(tmp_path)
    assert list(tmp_path.iterdir()) == [tmp_path / "engine.py"]


def test_a_read_only_install_caches_in_the_users_directory(tmp_path):
    """kvprof installed where it cannot write (a read-only site-packages): importing the core works and
    compiled code is cached in numba's per-user cache directory, then loaded from it by the next process."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    import kvprof

    site = tmp_path / "site"
    shutil.copytree(Path(kvprof.__file__).parent, site / "kvprof", ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "user-cache"
    script = ("import numpy as np; from kvprof.core import structs; structs.grown(np.zeros(2, np.int64), 5, 0); "
              "print(structs.grown.stats.cache_hits.get(structs.grown.signatures[0], 0), structs.grown.stats.cache_misses)")
    env = {**os.environ, "PYTHONPATH": str(site), "XDG_CACHE_HOME": str(cache)}
    env.pop("NUMBA_CACHE_DIR", None)
    read_only = f"mount --bind {site} {site} && mount -o remount,bind,ro {site} && touch {site}/probe 2>/dev/null; " \
                f"for run in 1 2; do {sys.executable} -c '{script}' || exit 1; done"
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", read_only], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp_path)  # not the repository: python -c puts the cwd first on sys.path
    if proc.returncode != 0 and ("unshare" in proc.stderr or "mount" in proc.stderr):
        pytest.skip(f"cannot make a read-only mount here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr
    first, second = (line.split() for line in proc.stdout.splitlines())
    assert not (site / "probe").exists() and not (site / "kvprof" / "core" / "__pycache__").exists()
    assert first[0] == "0" and second[0] == "1", proc.stdout  # compiled once, then loaded from the cache
    assert list(cache.rglob("*.nbi")), "numba cached nothing in the user's cache directory"


def test_stale_caches_are_dropped_wherever_numba_keeps_them(tmp_path, monkeypatch):
    from kvprof.core import cache_directories

    package = tmp_path / "core"
    package.mkdir()
    (package / "policies.py").write_text("")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user"))
    directories = cache_directories(package)
    assert directories[0] == package / "__pycache__"
    assert [d.parent for d in directories[1:]] == [tmp_path / "numba", tmp_path / "user" / "numba"]
    stale = []
    for directory in directories:
        directory.mkdir(parents=True)
        stale.append(directory / "policies.f-1.py311.nbi")
        stale[-1].write_text("")
        os.utime(stale[-1], (1000, 1000))
    os.utime(package / "policies.py", (2000, 2000))
    drop_stale_caches(package)
    assert not any(path.exists() for path in stale)


def test_the_copiers_module_is_what_the_structs_fields_generate():
    """kvprof.core.copiers is written out so numba can cache it: a struct field added without
    writing it again would go uncopied (``python -m kvprof.core.copiers`` writes it)."""
    from pathlib import Path

    from kvprof.core import copiers
    from kvprof.core.structs import copiers_source

    assert Path(copiers.__file__).read_text() == copiers_source(), \
        "kvprof/core/copiers.py is stale: run `python -m kvprof.core.copiers` and commit it"


def test_the_free_order_copier_is_loaded_from_the_cache_by_a_second_process():
    """``order`` (vLLM's get_all_free_blocks through the twin) was compiled at every start: now
    the second process finds every signature it needs in the cache."""
    import subprocess
    import sys

    script = ("import numpy as np; from kvprof.core import handle; from kvprof.core.twin import CompiledTwin; "
              "from kvprof.policy import make_policy; t = CompiledTwin(make_policy('lru'), 8); "
              "t.access(1, 0.0); t.free([1], 1.0); print(list(t.order(2.0)), "
              "sum(handle.order.stats.cache_misses.values()), sum(handle.order.stats.cache_hits.values()))")
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                           check=True).stdout.split() for _ in range(2)]  # the first may compile it
    assert runs[0][0] == runs[1][0] == "[1]"
    assert runs[1][-1] == "1", f"the second process compiled order again: {runs[1]}"

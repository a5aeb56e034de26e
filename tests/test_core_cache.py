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

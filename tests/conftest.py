"""What holds for every test: kvprof never writes a file its own loaders refuse.

Every hp file saved (``fit``, ``compare``, ``demo``, tuning, the tests' own) is loaded back and
must equal what was saved; every results document written (``compare``, ``replay``, ``show``'s
inputs) is loaded back by :func:`kvprof.results.load`. A producer that writes what a reader
refuses fails the test that made it write, whichever test that is.
"""

from __future__ import annotations

import pytest

from kvprof import results
from kvprof.models import hp as hp_module


@pytest.fixture(autouse=True)
def _outputs_load_back(monkeypatch):
    save, write = hp_module.HpFile.save, results.write

    def save_and_load(self, path):
        save(self, path)
        if _regular(path):
            assert hp_module.load_hp(path) == self, f"{path}: the saved hp file loads as another"

    def write_and_load(path, document):
        written = write(path, document)
        if _regular(path):
            assert results.load(path) == document, f"{path}: the written results load as another"
        return written

    monkeypatch.setattr(hp_module.HpFile, "save", save_and_load)
    monkeypatch.setattr(results, "write", write_and_load)


def _regular(path) -> bool:
    """Whether ``path`` is a regular file (not /dev/null or a FIFO, which cannot be read back)."""
    import os
    import stat

    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False

"""A compiled policy behind the :class:`~kvprof.policy.base.EvictionPolicy` interface.

One Python call per protocol call, so it is no faster than the reference per block; it lets a
driver that speaks the interface (the differential tests, the vLLM adaptor) run the compiled
core. The simulator's compiled engine drives the core directly instead.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable

import numpy as np

from kvprof.core import policy as core
from kvprof.core.build import compile_policy
from kvprof.policy.base import EvictionPolicy


class CompiledTwin(EvictionPolicy):
    """The compiled twin of a fresh reference policy, same name, same decisions.

    Invariant: ``_content_id`` numbers the contents seen so far densely (the core keys its
    ghosts and shadows by content number), so two contents are equal here exactly when they
    are equal for the reference.

    Parameters
    ----------
    reference : EvictionPolicy
        A fresh instance of a class with a twin (:data:`kvprof.core.build.TWINS`); only read.
    """

    def __init__(self, reference: EvictionPolicy) -> None:
        self.name = reference.name
        self.keyed_by = reference.keyed_by
        self.handle = compile_policy(reference)
        self._content_id: dict[Hashable, int] = {}
        self._out = np.zeros(64, dtype=np.int64)

    def access(
        self,
        block: int,
        now: float,
        workload: int = 0,
        depth: int = 0,
        *,
        hit: bool = False,
        next_use: float = math.inf,
        content: Hashable | None = None,
    ) -> None:
        content_id = -1 if content is None else self._content_id.setdefault(content, len(self._content_id))
        core.policy_access(self.handle, block, float(now), workload, depth, hit, float(next_use), content_id)

    def free(self, blocks: Iterable[int], now: float) -> None:
        blocks = np.fromiter(blocks, dtype=np.int64)
        if len(blocks):
            core.policy_free(self.handle, blocks, len(blocks), float(now))

    def remove(self, block: int) -> None:
        if block not in self:
            raise KeyError(block)
        core.policy_remove(self.handle, block)

    def evict(self, now: float) -> int:
        return self.evict_n(1, now)[0]

    def evict_n(self, n: int, now: float) -> list[int]:
        return self.evict_n_array(n, now).tolist()

    def evict_n_array(self, n: int, now: float) -> np.ndarray:
        if n > len(self):
            raise IndexError(f"{n} victims asked for, {len(self)} evictable")
        out = np.empty(n, dtype=np.int64)
        if n:
            core.policy_evict_n(self.handle, n, float(now), out, 0)
        return out

    def order(self, now: float, limit: int | None = None) -> list[int]:
        raise NotImplementedError("a compiled twin cannot walk its order without evicting")

    def clear(self) -> None:
        raise NotImplementedError("build a fresh twin instead")

    def __len__(self) -> int:
        return core.policy_size(self.handle)

    def __contains__(self, block: int) -> bool:
        return core.policy_contains(self.handle, block)

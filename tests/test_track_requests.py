"""The plugin's seams in vLLM's scheduler (kvprof.vllm.plugin.track_requests), on stand-ins for the scheduler
and its KV-cache manager with vLLM's method names: another wrapper of ``allocate_slots`` is composed with, and
the blocks running requests take are told as they are taken and claimed at the request's free.

The real scheduler is exercised in tests/vllm (test_outputs_live.py, test_loop.py)."""

from __future__ import annotations

from types import SimpleNamespace

from kvprof.vllm.plugin import track_requests


class Manager:
    """vLLM's ``KVCacheManager`` as the plugin reaches it: a lookup, ``allocate_slots``, the coordinator's
    per-request block lists and the block pool."""

    def __init__(self):
        self.held: dict[str, list] = {}
        self.next_id = 1
        self.block_pool = SimpleNamespace(num_gpu_blocks=64, get_new_blocks=self._new_blocks)
        self.coordinator = SimpleNamespace(get_blocks=lambda rid: (self.held.get(rid, []),))

    def _new_blocks(self, n):
        blocks = [SimpleNamespace(block_id=self.next_id + i) for i in range(n)]
        self.next_id += n
        return blocks

    def get_computed_blocks(self, request):
        return [], 0

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0):
        n = -(-(request.num_computed + num_new_tokens) // 4) - len(self.held.setdefault(request.request_id, []))
        if n > 0:
            self.held[request.request_id] += self.block_pool.get_new_blocks(n)
        return self.held[request.request_id]


class Live:
    def __init__(self):
        self.spec = SimpleNamespace(tool_call_tokens=frozenset())
        self.recorder = object()  # recording: the times blocks are taken are kept
        self.events = []

    def scheduled(self, request, now, n_first):
        self.events.append(("admit", request.request_id, n_first))

    def grew(self, ids, now):
        self.events.append(("grow", ids.tolist()))

    def finished(self, request, scheduled, hit_tokens, now, code, grown, grown_at):
        self.events.append(("finish", request.request_id, grown.tolist(), len(grown_at)))

    def poll(self):
        pass

    def close(self):
        pass


def installed():
    manager, live = Manager(), Live()
    scheduler = SimpleNamespace(connector=None, schedule=lambda: None, shutdown=lambda: None,
                                _free_request=lambda request: manager.held.pop(request.request_id, None))
    track_requests(scheduler, manager, None, live)
    return scheduler, manager, live


def request(rid):
    return SimpleNamespace(request_id=rid, num_computed=0, sampling_params=None, output_token_ids=[],
                           get_finished_reason=lambda: None, status=None)


def test_a_wrapper_of_allocate_slots_installed_after_kvprof_is_composed_with_not_replaced():
    scheduler, manager, live = installed()
    seen = []
    inner = manager.allocate_slots

    def spy(req, *args, **kwargs):
        seen.append(req.request_id)
        return inner(req, *args, **kwargs)

    manager.allocate_slots = spy
    first = request("a")
    manager.get_computed_blocks(first)  # vLLM looks a waiting request's hits up, then allocates
    manager.allocate_slots(first, 6)
    assert seen == ["a"] and manager.allocate_slots is spy  # called through kvprof's wrapper, then put back
    assert live.events == [("admit", "a", 2)]
    first.num_computed = 6
    manager.allocate_slots(first, 3)  # a running request's decode step that starts a block: the spy alone
    assert seen == ["a", "a"]
    assert live.events[1:] == [("grow", [3])]
    scheduler._free_request(first)
    assert live.events[2:] == [("finish", "a", [3], 1)]  # the block it took while running, and when

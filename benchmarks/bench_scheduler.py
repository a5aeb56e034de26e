"""Scheduler cost: vLLM's real v1 ``Scheduler`` with its native block pool against kvprof's policies.

Run with the vLLM venv's python (one process, no model, no server)::

    .venv-vllm/bin/python benchmarks/bench_scheduler.py [--pools 50000 200000 500000] [--json]

For each pool size and each configuration (``native``: vLLM's own pool; ``lru``, ``s3fifo``,
``arc``, ``wa``: kvprof's plugin enforcing that policy; ``wa+record``: ``wa`` with ``--kv-record``
on, the live counterfactual beside it as always; ``wa+long-output``: ``wa`` from a file tuned with a
long-output limit, so with that candidate too; ``wa+first-turn``: ``wa`` from a file whose next-turn
counts switch it to its ``first-turn`` candidate and LRU; ``wa+shadow``: ``--kv-policy-mode shadow``, vLLM's own
eviction with ``wa`` replayed beside it on the block hashes) it builds vLLM's scheduler the way ``vllm serve``
does (the class from ``scheduler_config.get_scheduler_cls()``, so the plugin installs itself), feeds
it the same traffic, and after each ``schedule()`` hands it a model output with one sampled token
per scheduled request that is past its prompt, as the engine core would. It reports per step the
scheduler's time (``schedule`` + ``update_from_output``: median, p99, total), the time added per
block allocated against native, and the longest single kvprof call on the scheduler thread
(timed in a second pass with kvprof's entry points wrapped, so the step times stay unwrapped).

Traffic (synthetic, seeded; the same for every configuration):

* ``bailian`` -- prompts of lognormal length, mean ~2,300 tokens, each starting with one of
  20 shared system prompts of 512-2,048 tokens; 16-128 output tokens;
* ``agent`` -- sessions whose context grows turn by turn (previous prompt + its output + 2k-8k
  new tokens) up to ``--agent-max`` tokens (default 32k; 128k with the flag), the WEKA dev
  trace's shape;
* ``prefill`` -- prompts of ``--prefill-tokens`` tokens (32k by default, 128k with the flag), unique
  past one of the 20 shared system prompts: long-context traffic on a cache miss, prefill-heavy;
  with ``--running`` as large as ``--requests`` they are all queued at once.

``--running`` requests are kept in flight (a closed loop: a finished request is replaced at once).

No model runs, so the scheduler thread never idles: a thread of kvprof's (``wa``'s shadow feed,
:mod:`kvprof.core.shadow_feed`) gets the CPU only beside it, and an eviction that waits for that
thread waits for work a GPU server would have done during the model's forward pass.
``--step-idle-ms`` sleeps that long after each step (outside the timed figures) to stand for the
forward pass: the time a server's scheduler thread waits for the GPU. Step and call times are the
scheduler thread's CPU time; its waits for kvprof's threads (on a lock, or for the GIL) show only in
the wall-clock figures (``wall_*``, ``longest_wall_us``) and, for the shadow feed, in ``feed_waits``
(per reason: count, total ms, longest ms). The call pass also times Python's automatic cyclic
collections on the scheduler thread (``gc_collections``: per generation, count and longest us) and
gives each call's longest less the collections that ran inside it (``longest_less_gc_us``,
``max_kvprof_call_less_gc_us``): a collection runs in whichever call allocates past its threshold,
native or kvprof's, and walks every young object (vLLM's new requests and their token lists).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

import numpy as np  # noqa: E402

CONFIGS = ("native", "lru", "s3fifo", "arc", "wa", "wa+record", "wa+long-output", "wa+first-turn", "wa+shadow")
BLOCK = 16
#: ``wa+long-output``'s limit: the middle of the traffic's outputs (16-128 tokens), so about half the
#: requests' blocks are freed to its first list.
LONG_OUTPUT_TOKENS = 64.0
#: ``wa+first-turn``'s next-turn counts: continued sessions came back 6 times as often as new ones.
FAVOURING_NEXT_TURN = {"horizon_s": 30.0, "began": 1000, "began_followed": 50, "continued": 100, "continued_followed": 30}
VOCAB = 30000


# -- traffic ---------------------------------------------------------------------------------------
class Traffic:
    """Prompts in arrival order; an agent session's next turn is queued when its last turn finishes.

    Invariant: ``next()`` returns a prompt for every call until ``total`` prompts were handed out;
    a session's turn ``k + 1`` extends turn ``k``'s prompt and output.
    """

    def __init__(self, kind: str, total: int, seed: int, agent_max: int, prefill_tokens: int = 32768) -> None:
        self.rng = np.random.default_rng(seed)
        self.kind, self.total, self.agent_max, self.prefill_tokens = kind, total, agent_max, prefill_tokens
        self.given = 0
        self.systems = [self._tokens(int(n)) for n in self.rng.integers(512, 2049, 20)]
        self.ready: list = []  # (prompt, tags, session) of agent turns waiting to be sent
        self.sessions = 0

    def _tokens(self, n: int) -> list[int]:
        return self.rng.integers(100, VOCAB, n).tolist()

    def next(self):
        """(prompt tokens, output length, tags, session or None) of the next request, or None."""
        if self.given >= self.total:
            return None
        self.given += 1
        out_len = int(self.rng.integers(16, 129))
        if self.kind == "prefill":
            system = self.systems[int(self.rng.integers(len(self.systems)))]
            return system + self._tokens(self.prefill_tokens - len(system)), out_len, {"type": "text", "turn": 1}, None
        if self.kind == "bailian" or (self.kind == "mixed" and self.rng.random() < 0.5):
            n = int(min(max(self.rng.lognormal(7.4, 0.8), 64), 16000))  # mean ~2,300
            system = self.systems[int(self.rng.integers(len(self.systems)))]
            prompt = system[:n] + self._tokens(max(n - len(system), 16))
            return prompt, out_len, {"type": "text", "turn": 1}, None
        if self.ready:
            prompt, turn, session = self.ready.pop(0)
            return prompt, out_len, {"type": "agent", "turn": turn}, session
        self.sessions += 1
        system = self.systems[int(self.rng.integers(len(self.systems)))]
        return system + self._tokens(int(self.rng.integers(2000, 8001))), out_len, {"type": "agent", "turn": 1}, \
            (self.sessions, 1)

    def finished(self, session, prompt: list[int], output: list[int]) -> None:
        """A turn of ``session`` finished with ``output``: queue the next turn while the context fits."""
        if session is None:
            return
        grown = prompt + output + self._tokens(int(self.rng.integers(2000, 8001)))
        if len(grown) + 256 <= self.agent_max:
            self.ready.append((grown, session[1] + 1, (session[0], session[1] + 1)))


# -- vLLM ------------------------------------------------------------------------------------------
def hp_file(path: Path, long_output_tokens: float | None = None, next_turn: dict | None = None) -> str:
    """A small valid hp file (classes of the traffic's tags) for ``wa``; with ``long_output_tokens``, tuned
    (for every size: one entry) with that limit for the long-output candidate; with ``next_turn``, those counts."""
    from kvprof.models.hp import SCHEMA, HpFile

    classes = {f"{kind}_{turn}": {"p": p, "lambda": lam}
               for kind, p, lam in (("text", 0.3, 0.05), ("agent", 0.8, 0.01)) for turn in range(1, 6)}
    document = {"schema": "kvprof.hp/1", "horizon_s": 60.0, "min_gap_s": 0.3,
                "class_rule": {"key": "type_turn", "turn_cap": 5}, "classes": classes,
                "default": {"p": 0.2, "lambda": 0.05}}
    if long_output_tokens is not None:
        document.update(schema=SCHEMA, tuning=[{"capacity": 1, "horizon_s": 60.0, "start": "model",
                                                "long_output_tokens": long_output_tokens}])
    if next_turn is not None:
        document.update(schema=SCHEMA, next_turn=next_turn)
    HpFile.from_dict(document).save(path)
    return str(path)


def build_scheduler(config: str, args, work: Path):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    additional = {}
    if config != "native":
        policy = config.split("+")[0]
        entry = {"policy": policy, "reload_interval_s": 0, "log_interval_s": 0}
        if policy == "wa":
            tuned = {"wa+long-output": args.hp_long_output, "wa+first-turn": args.hp_first_turn}
            entry["config"] = tuned.get(config, args.hp)
        if config.endswith("+record"):
            entry["record"] = str(work / f"record-{time.monotonic_ns()}")
        if config.endswith("+shadow"):
            entry["mode"] = "shadow"
        additional = {"kv_policy": entry}
    model = ModelConfig(model=args.model, max_model_len=args.max_model_len, seed=0, dtype="float32")
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, gpu_memory_utilization=0.9)
    cache.num_gpu_blocks = args.pool
    sched = SchedulerConfig(max_num_seqs=args.running, max_num_batched_tokens=args.batched_tokens,
                            max_model_len=args.max_model_len, enable_chunked_prefill=True,
                            is_encoder_decoder=False)
    vllm_config = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched,
                             additional_config=additional)
    kv = KVCacheConfig(num_blocks=args.pool, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32,
                                                        dtype=__import__("torch").float32))])
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    assert issubclass(cls, Scheduler)
    scheduler = cls(vllm_config=vllm_config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(
        vllm_config), block_size=BLOCK, log_stats=False)
    live = getattr(scheduler, "_kvprof_live", None)
    if live is not None:  # measure the policy, not vLLM's own order, which serves while kvprof's core loads
        assert live.wait_ready(900), "kvprof's compiled core did not load"
        live.poll()  # the hand-over, as the first step would make it
    return scheduler


class CallTimer:
    """Wraps kvprof's entry points on the scheduler thread; keeps the longest call of each, and of each the
    longest less the time Python's cyclic GC collected inside it (a collection runs in whichever call
    allocates past the threshold, mostly walking vLLM's young requests: the same pauses native's steps have)."""

    def __init__(self) -> None:
        self.longest: dict[str, float] = {}  # this thread's CPU time
        self.longest_less_gc: dict[str, float] = {}  # the same, less the collections inside the call
        self.longest_wall: dict[str, float] = {}  # with its waits for other threads (and the machine's load)
        self.collections: list[tuple[int, float]] = []  # (generation, CPU seconds) of each automatic collection
        self._gc = [0.0, 0.0]  # CPU seconds collecting so far, and when the running collection started

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc[1] = time.thread_time()
        else:
            spent = time.thread_time() - self._gc[1]
            self._gc[0] += spent
            self.collections.append((info["generation"], spent))

    def wrap(self, obj, name: str, label: str) -> None:
        original = getattr(obj, name)
        longest, longest_less_gc, longest_wall, collected = self.longest, self.longest_less_gc, self.longest_wall, self._gc
        clock, wall = time.thread_time, time.perf_counter

        def timed(*a, **k):
            t, w, g = clock(), wall(), collected[0]
            try:
                return original(*a, **k)
            finally:
                dt, dw = clock() - t, wall() - w
                if dt > longest.get(label, 0.0):
                    longest[label] = dt
                if dt - (collected[0] - g) > longest_less_gc.get(label, 0.0):
                    longest_less_gc[label] = dt - (collected[0] - g)
                if dw > longest_wall.get(label, 0.0):
                    longest_wall[label] = dw

        setattr(obj, name, timed)

    def install(self, scheduler) -> None:
        pool = scheduler.kv_cache_manager.block_pool
        queue = pool.free_block_queue
        for name in ("popleft", "popleft_n", "remove", "append", "append_n", "prepend_n", "get_all_free_blocks"):
            if hasattr(queue, name):
                self.wrap(queue, name, f"queue.{name}")
        for name in ("_access_chain", "_access_numbered", "_note_chain", "admit_request", "finish_request",
                     "replace_policy"):  # _access_chain: the pool before this benchmark's changes
            if hasattr(pool, name):
                self.wrap(pool, name, f"pool.{name}")
        if hasattr(pool, "contents"):  # the pool's compiled content numbering
            self.wrap(pool.contents, "numbers", "pool.contents.numbers")
        elif hasattr(getattr(pool, "policy", None), "numbers"):  # the pool before it numbered contents itself
            self.wrap(pool.policy, "numbers", "policy.numbers")
        live = getattr(scheduler, "_kvprof_live", None)
        if live is not None:
            for name in ("scheduled", "finished", "poll"):
                self.wrap(live, name, f"live.{name}")


def run(config: str, args, work: Path, timed_calls: bool) -> dict:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    try:
        from vllm.utils.gc_utils import freeze_gc_heap
    except ImportError:  # a vLLM that does not freeze its heap

        def freeze_gc_heap():
            gc.collect()

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BLOCK, sha256_cbor)
    gc.collect()
    malloc_before = malloc_bytes()
    scheduler = build_scheduler(config, args, work)
    gc.collect()
    malloc_built = malloc_bytes() - malloc_before  # the tables sized by the pool, before any traffic
    timer = CallTimer() if timed_calls else None
    if timer:
        timer.install(scheduler)
    traffic = Traffic(args.traffic, args.requests, args.seed, args.agent_max, args.prefill_tokens)
    meta = {}  # request id -> (prompt, session)
    serial = [0]

    def add():
        item = traffic.next()
        if item is None:
            return False
        prompt, out_len, tags, session = item
        rid = f"r{serial[0]}"
        serial[0] += 1
        params = SamplingParams(max_tokens=out_len, ignore_eos=True, extra_args=tags)
        scheduler.add_request(Request(rid, prompt, params, None, block_hasher=hasher))
        meta[rid] = (prompt, session)
        return True

    for _ in range(args.running):
        add()
    steps = []
    allocated = 0
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    count_pop = queue.popleft_n

    def counting(n, _pop=count_pop):
        nonlocal allocated
        allocated += n
        return _pop(n)

    queue.popleft_n = counting
    # vLLM's engine core freezes the heap once the scheduler is built (``freeze_gc_heap``), so a full
    # collection never walks the pool's blocks while serving; without it one lands inside some
    # kvprof or vLLM call now and then and costs milliseconds.
    freeze_gc_heap()
    if timer:
        gc.callbacks.append(timer.on_gc)
    clock = time.thread_time  # this thread's CPU time: the shared machine's other jobs do not count
    wall, cpu_start, scheduler_start = [], time.process_time(), time.thread_time()
    wall_clock = time.perf_counter
    while scheduler.has_requests() and len(steps) < args.max_steps:
        w0 = wall_clock()
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = scheduler.requests[rid]
            done = req.num_computed_tokens + out.num_scheduled_tokens[rid] >= req.num_tokens
            sampled.append([(hash(rid) + req.num_output_tokens) % VOCAB + 100] if done else [])
        model_out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                      sampled_token_ids=sampled)
        finished = [r for r in ids if sampled[ids.index(r)] and
                    scheduler.requests[r].num_output_tokens + 1 >= scheduler.requests[r].max_tokens]
        outputs = {r: list(scheduler.requests[r].output_token_ids) for r in finished}
        t2 = clock()
        scheduler.update_from_output(out, model_out)
        t3 = clock()
        wall.append(wall_clock() - w0)
        steps.append((t1 - t0) + (t3 - t2))
        if args.step_idle_ms:
            time.sleep(args.step_idle_ms / 1000)  # the model's forward pass: this thread waits for the GPU
        for r in finished:
            prompt, session = meta.pop(r)
            traffic.finished(session, prompt, outputs[r] + [sampled[ids.index(r)][0]])
        while len(scheduler.running) + len(scheduler.waiting) < args.running and add():
            pass
    if timer:
        gc.callbacks.remove(timer.on_gc)
    other_threads_s = (time.process_time() - cpu_start) - (clock() - scheduler_start)
    feed = getattr(getattr(scheduler.kv_cache_manager.block_pool, "policy", None), "shadow_feed", None)
    feed_waits = {} if feed is None else {reason: [count, total * 1e3, longest * 1e3]
                                          for reason, (count, total, longest) in feed.waits.items()}
    gc.unfreeze()
    gc.collect()
    malloc_held = malloc_bytes() - malloc_before
    scheduler.shutdown()
    us = np.array(steps) * 1e6
    result = {"steps": len(steps), "median_step_us": float(np.median(us)), "p99_step_us": float(np.percentile(us, 99)),
              "total_s": float(us.sum() / 1e6), "blocks_allocated": allocated,
              "wall_median_step_us": float(np.median(wall) * 1e6), "wall_p99_step_us": float(np.percentile(wall, 99) * 1e6),
              "other_threads_cpu_s": other_threads_s, "feed_waits": feed_waits,
              "malloc_held": malloc_held, "malloc_built": malloc_built}
    if timer:
        result["longest_us"] = {k: v * 1e6 for k, v in sorted(timer.longest.items())}
        result["max_kvprof_call_us"] = max(result["longest_us"].values(), default=0.0) if config != "native" else 0.0
        result["longest_less_gc_us"] = {k: v * 1e6 for k, v in sorted(timer.longest_less_gc.items())}
        result["max_kvprof_call_less_gc_us"] = (max(result["longest_less_gc_us"].values(), default=0.0)
                                                if config != "native" else 0.0)
        result["gc_collections"] = {f"gen{g}": [sum(1 for c in timer.collections if c[0] == g),
                                                max((c[1] * 1e6 for c in timer.collections if c[0] == g), default=0.0)]
                                    for g in range(3)}
        result["longest_wall_us"] = {k: v * 1e6 for k, v in sorted(timer.longest_wall.items())}
        result["max_kvprof_call_wall_us"] = (max(result["longest_wall_us"].values(), default=0.0)
                                             if config != "native" else 0.0)
    return result


def malloc_bytes() -> int:
    """Bytes the C allocator has handed out (glibc ``mallinfo2``: small chunks plus mmapped ones):
    numpy's arrays, the compiled core's arrays (numba's runtime mallocs them) and the item arrays
    of large Python lists; not the small Python objects pymalloc keeps in its own arenas."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def best(results) -> dict:
    """The lowest of each timing over repeated runs (the others are the shared machine's noise)."""
    results = list(results)
    out = dict(results[0])
    for key in ("median_step_us", "p99_step_us", "total_s", "wall_median_step_us", "wall_p99_step_us"):
        out[key] = min(r[key] for r in results)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pools", type=int, nargs="+", default=[20000],
                    help="GPU blocks (50000 200000 500000 for the full shapes)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--traffic", choices=("bailian", "agent", "mixed", "prefill"), default="mixed")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--running", type=int, default=64, help="requests kept in flight (max_num_seqs)")
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--agent-max", type=int, default=32768, help="agent sessions grow to this many tokens")
    ap.add_argument("--prefill-tokens", type=int, default=32768, help="--traffic prefill: each prompt's length")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-idle-ms", type=float, default=0.0,
                    help="sleep this long after each step, untimed: the model's forward pass a server waits for")
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration (the best of each figure)")
    ap.add_argument("--profile", metavar="CONFIG", help="cProfile one run of CONFIG and print the top functions")
    ap.add_argument("--no-call-pass", action="store_true", help="skip the pass that times each kvprof call")
    ap.add_argument("--model", default=None, help="a model directory (config only; default: build the tiny one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import kvprof.vllm.plugin as plugin

    plugin.register()
    with tempfile.TemporaryDirectory(prefix="bench-sched-") as tmp:
        work = Path(tmp)
        if args.model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
            import tiny_model

            args.model = str(work / "tiny")
            tiny_model.build(args.model)
        args.hp = hp_file(work / "hp.json")
        args.hp_long_output = hp_file(work / "hp-long-output.json", LONG_OUTPUT_TOKENS)
        args.hp_first_turn = hp_file(work / "hp-first-turn.json", next_turn=FAVOURING_NEXT_TURN)
        if args.profile:
            import cProfile
            import pstats

            args.pool = args.pools[0]
            run(args.profile, argparse.Namespace(**{**vars(args), "pool": 2000, "requests": 12, "running": 8}), work,
                timed_calls=False)
            profiler = cProfile.Profile()
            profiler.runcall(run, args.profile, args, work, False)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats("kvprof/", 30)  # kvprof's share
            return
        report = {"pools": {}}
        warm = argparse.Namespace(**{**vars(args), "pool": 2000, "requests": 12, "running": 8})
        for config in args.configs:  # load every compiled function once, outside the figures
            run(config, warm, work, timed_calls=True)
        for pool in args.pools:
            args.pool = pool
            rows = {}
            for config in args.configs:
                rows[config] = best(run(config, args, work, timed_calls=False) for _ in range(args.repeat))
                if not args.no_call_pass and config != "native":
                    calls = run(config, args, work, True)
                    for key in ("max_kvprof_call_us", "longest_us", "max_kvprof_call_less_gc_us", "longest_less_gc_us",
                                "gc_collections", "max_kvprof_call_wall_us", "longest_wall_us", "feed_waits"):
                        rows[config][key if key != "feed_waits" else "call_pass_feed_waits"] = calls[key]
                if not args.json:
                    print(f"  {pool} {config}: {rows[config]}", file=sys.stderr, flush=True)
            native = rows.get("native")
            for name, row in rows.items():
                for figure, held in (("plugin_bytes_per_block", "malloc_held"),
                                     ("plugin_built_bytes_per_block", "malloc_built")):
                    row[figure] = (row[held] - native[held]) / pool if native and name != "native" else 0.0
                if native and name != "native":
                    row["median_x_native"] = row["median_step_us"] / native["median_step_us"]
                    row["p99_x_native"] = row["p99_step_us"] / native["p99_step_us"]
                    row["wall_median_x_native"] = row["wall_median_step_us"] / native["wall_median_step_us"]
                    row["wall_p99_x_native"] = row["wall_p99_step_us"] / native["wall_p99_step_us"]
                    row["added_us_per_block"] = ((row["total_s"] - native["total_s"]) * 1e6
                                                 / max(native["blocks_allocated"], 1))
            report["pools"][pool] = rows
        largest = report["pools"][max(args.pools)]
        report["pool"], report["traffic"], report["running"] = max(args.pools), args.traffic, args.running
        report["shape"] = (f"{args.requests} prompts of {args.prefill_tokens:,} tokens, {args.running} queued at once"
                           if args.traffic == "prefill" else f"{args.traffic} traffic, {args.running} running")
        report["configs"] = {name: {key: row.get(key, 0.0) for key in ("median_step_us", "p99_step_us",
                                                                      "max_kvprof_call_us")}
                             for name, row in largest.items()}
    if args.json:
        print(json.dumps(report))
        return
    for pool, rows in report["pools"].items():
        print(f"pool {pool} blocks, {args.traffic} traffic, {args.running} running, {args.requests} requests")
        print(f"{'config':>10} {'steps':>6} {'median us':>10} {'x nat':>6} {'p99 us':>9} {'x nat':>6} "
              f"{'total s':>8} {'+us/blk':>8} {'max call us':>12} {'B/blk':>6} {'built':>6}")
        for name, row in rows.items():
            print(f"{name:>10} {row['steps']:>6} {row['median_step_us']:>10.0f} {row.get('median_x_native', 1):>6.2f} "
                  f"{row['p99_step_us']:>9.0f} {row.get('p99_x_native', 1):>6.2f} {row['total_s']:>8.2f} "
                  f"{row.get('added_us_per_block', 0):>8.2f} {row.get('max_kvprof_call_us', 0):>12.0f} "
                  f"{row['plugin_bytes_per_block']:>6.0f} {row['plugin_built_bytes_per_block']:>6.0f}")


if __name__ == "__main__":
    main()

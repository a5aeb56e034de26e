"""What ``additional_config["kv_policy"]`` means: parsing, validation and request classes.

This module does not import vLLM, so it is shared by the plugin (API-server side, where the
configuration is checked before the engine starts) and the engine core (where the block pool is
built), and can be tested without vLLM.

The configuration (every key optional; ``vllm serve`` flags in brackets)::

    additional_config = {"kv_policy": {
        "config": "hp.json",          # [--kv-policy-config] a kvprof hyperparameter file (kvprof fit)
        "policy": "wa",               # [--kv-policy] a live policy of kvprof.policy.POLICIES
        "mode": "enforce",            # [--kv-policy-mode] enforce: the policy evicts; shadow: vLLM's
                                      #   own eviction stays, the policy runs beside it on block hashes
        "record": "DIR",              # [--kv-record] write the served requests as a trace
        "record_rotate_s": 3600,      # [--kv-record-rotate] seconds per trace file
        "record_key": "FILE",         # [--kv-record-key] the block-id key a fleet's servers share
        "reload_interval_s": 10,      # [--kv-policy-reload-interval] re-read a changed hp file; 0: never
        "log_interval_s": 300,        # [--kv-log-interval] seconds between hit-ratio log lines; 0: never
        "tool_call_tokens": [151657], # [--kv-tool-call-tokens] token ids that mark a response as a tool
                                      #   call: each finish tells the policy and the recording how the
                                      #   request ended (kvprof.vllm.finish)
        "hint_max_fraction": 0.2,     # [--kv-hint-max-fraction] retained blocks hold at most this share
                                      #   of the pool, per tag and in all (default: no budget; docs/hints.md)
        "hint_counterfactual": True,  # [--kv-hint-counterfactual] replay the served policy beside the
                                      #   server without the clients' hints: what they were worth (metrics)
    }}

``policy`` defaults to ``wa`` when ``config`` is given; a policy that needs no hp file (NO_HP_POLICIES)
may omit ``config``. ``record`` alone records and leaves vLLM's
eviction untouched (a new user's first step). Anything wrong -- unknown keys, a missing or invalid
file, an unknown policy, a bad number -- raises :class:`KvPolicyConfigError`; there is no silent
fall-back to vLLM's LRU.

Requests name their workload in ``SamplingParams.extra_args`` (the OpenAI server fills it from
``vllm_xargs``): either ``{"workload": "text_2"}`` or the trace fields ``{"type": "text", "turn": 2}``
(plus the keyed field when the hp file's class rule is ``field``, and the fields its cell rule
reads), classified with the hp file's class rule by :func:`kvprof.classes.workload_class` and,
for policies keyed by cells (``wa``), placed in a cell by its cell rule with the prompt's length,
exactly as the profiler did. Untagged requests get the default class (and the cell the rule
gives a request of no class).

Requests may also carry a client hint in the same ``extra_args`` (``retain_s``, ``retain_priority``,
``release``, ``hint_tag``, ``hint_session``: :func:`kvprof.models.hints.hint_of_args`), which the pool honours
(:class:`kvprof.policy.hinted.HintLayer`) and the recorder keeps.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from kvprof import registry
from kvprof.errors import KvprofError
from kvprof.limits import SECONDS, Bound, _shown

if __doc__:  # the policies that need no hp file, from the registry (none under python -OO)
    __doc__ = __doc__.replace("NO_HP_POLICIES", ", ".join(f"``{r.name}``" for r in registry.live() if not r.needs_hp))


def policy_help() -> str:
    """``--kv-policy``'s help: the live policies of :mod:`kvprof.registry`, those that need an hp file first."""
    with_hp = [r.name for r in registry.live() if r.needs_hp and r.name != DEFAULT_POLICY]
    alone = [r.name for r in registry.live() if not r.needs_hp]
    return (f"Eviction policy to serve: {DEFAULT_POLICY} (the default with --kv-policy-config) or {', '.join(with_hp)}, "
            f"which need --kv-policy-config; {', '.join(alone)}, which need none.")


#: Key of ``additional_config`` that holds kvprof's settings.
CONFIG_KEY = "kv_policy"
DEFAULT_POLICY = "wa"
#: vLLM releases the adaptor was built against: 0.30 <= version < 0.34.
SUPPORTED = ((0, 30), (0, 34))
MODES = ("enforce", "shadow")


@dataclass(frozen=True)
class Seconds:
    """A numeric setting: its default, the values it may take, and whether 0 turns it off."""

    default: float
    bound: Bound
    zero_is_off: bool


#: Numeric settings. The lower bounds keep a typo from costing the server: a recorded file per
#: request, a log line per event, a look at the hp file per event.
SECONDS_SETTINGS = {"record_rotate_s": Seconds(3600.0, Bound(1.0, 1e9), False),
           "reload_interval_s": Seconds(10.0, Bound(0.01, 1e9), True),
           "log_interval_s": Seconds(300.0, Bound(1.0, 1e9), True)}
#: Every key of ``kv_policy`` and the ``vllm serve`` flag that sets it.
FLAG_OF = {"config": "--kv-policy-config", "policy": "--kv-policy", "mode": "--kv-policy-mode",
           "record": "--kv-record", "record_rotate_s": "--kv-record-rotate", "record_key": "--kv-record-key",
           "reload_interval_s": "--kv-policy-reload-interval", "log_interval_s": "--kv-log-interval",
           "tool_call_tokens": "--kv-tool-call-tokens", "hint_max_fraction": "--kv-hint-max-fraction",
           "hint_counterfactual": "--kv-hint-counterfactual"}
_KEYS = tuple(FLAG_OF)


class KvPolicyConfigError(KvprofError, ValueError):
    """The ``kv_policy`` configuration cannot be served; vLLM must not start with it."""

    def __init__(self, message: str):
        super().__init__(f"kvprof kv_policy: {message}")


#: ``KVPROF_SHADOW_THREAD=0`` keeps ``wa``'s shadows on the scheduler thread (the synchronous feed the
#: simulator runs: the same decisions), for a host with no core to spare for their thread, where an
#: eviction's wait for the thread can outlast the work it would have done itself (docs/vllm.md).
SHADOW_THREAD_ENV = "KVPROF_SHADOW_THREAD"


def shadow_thread() -> bool:
    """Whether ``wa``'s shadows run on a thread of their own: :data:`SHADOW_THREAD_ENV` unset or ``1``.

    Raises
    ------
    KvPolicyConfigError
        The variable holds anything but ``0`` or ``1``.
    """
    value = os.environ.get(SHADOW_THREAD_ENV, "1")
    if value not in ("0", "1"):
        raise KvPolicyConfigError(f"{SHADOW_THREAD_ENV}={value!r}: give 1 (wa's shadows on a thread of their own, "
                                  "the default) or 0 (on the scheduler thread)")
    return value == "1"


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; digits of the leading release segment only."""
    parts = []
    for piece in re.split(r"[.+-]", text):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def check_version(version: str) -> None:
    """Refuse vLLM releases outside :data:`SUPPORTED`, naming the version found."""
    low, high = SUPPORTED
    found = parse_version(version)[:2]
    if not (low <= found < high):
        raise KvPolicyConfigError(
            f"vLLM {version} is not supported by kvprof's adaptor (supported: "
            f"{low[0]}.{low[1]} to {high[0]}.{high[1] - 1}); remove kv_policy or install a supported vLLM"
        )


@dataclass
class PolicySpec:
    """A validated ``kv_policy`` configuration, with its hp file loaded.

    Attributes
    ----------
    policy : str or None
        Policy name (a key of :data:`kvprof.policy.POLICIES`); None when kvprof only records.
    config : str or None
        Path of the hp file.
    hp : kvprof.models.hp.HpFile or None
    class_names : tuple of str
        Class names in the policy's index order, the default last (``HpFile.table()``).
    keyed_by : {"class", "cell"}
        What the policy's ``access`` is told (its class ``keyed_by``).
    hp_sha256 : str or None
        sha256 of the hp file's bytes as loaded.
    mode : {"enforce", "shadow"}
        Whether the policy evicts in vLLM's pool or runs beside vLLM's own eviction.
    record : str or None
        Recording directory (``--kv-record``).
    record_key : str or None
        File of the block-id key shared with a fleet's other servers (``--kv-record-key``); None:
        a key of this start's own (unless the environment names one: :mod:`kvprof.vllm.record`).
    record_rotate_s, reload_interval_s, log_interval_s : float
        See the module's configuration; 0 turns reloading or logging off.
    tool_call_tokens : frozenset of int
        Token ids that mark a response as a tool call (``--kv-tool-call-tokens``); empty: the engine
        tells no finish code (:mod:`kvprof.vllm.finish`).
    hint_max_fraction : float or None
        The hint budget (``--kv-hint-max-fraction``): retained blocks hold at most this share of the
        pool, each hint tag's and all together; None: no budget.
    hint_counterfactual : bool
        Replay the served policy beside the server without the clients' hints (``--kv-hint-counterfactual``),
        so the metrics say what the hints were worth: its cached blocks against the server's.
    """

    policy: str | None
    config: str | None
    hp: Any = None
    class_names: tuple[str, ...] = ("<default>",)
    keyed_by: str = "class"
    mode: str = "enforce"
    record: str | None = None
    record_key: str | None = None
    record_rotate_s: float = 3600.0
    reload_interval_s: float = 10.0
    log_interval_s: float = 300.0
    tool_call_tokens: frozenset[int] = frozenset()
    hint_max_fraction: float | None = None
    hint_counterfactual: bool = False
    hp_sha256: str | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_additional_config(cls, additional_config: dict | None) -> PolicySpec | None:
        """The spec in ``additional_config``, or None when kvprof is not configured.

        Raises
        ------
        KvPolicyConfigError
        """
        if not additional_config or CONFIG_KEY not in additional_config:
            return None
        raw = additional_config[CONFIG_KEY]
        if raw is None:
            return None
        if isinstance(raw, str):  # the bare path is accepted too
            raw = {"config": raw}
        if not isinstance(raw, dict):
            raise KvPolicyConfigError(f"expected an object {{'config': PATH, 'policy': NAME}}, got {raw!r:.80}")
        unknown = sorted(set(raw) - set(_KEYS), key=str)
        if unknown:
            raise KvPolicyConfigError(f"unknown key(s) {unknown}; known: {', '.join(_KEYS)}")
        path, record, record_key = _path(raw, "config"), _path(raw, "record"), _path(raw, "record_key")
        live = [r.name for r in registry.live()]
        offline = [r.name for r in registry.by_name() if r.offline]
        name = _choice(raw, "policy", live, *offline)
        mode = _choice(raw, "mode", MODES) or "enforce"
        settings = {key: _seconds(key, raw.get(key), setting) for key, setting in SECONDS_SETTINGS.items()}
        settings["tool_call_tokens"] = _token_ids("tool_call_tokens", raw.get("tool_call_tokens"))
        settings["hint_max_fraction"] = _share("hint_max_fraction", raw.get("hint_max_fraction"))
        settings["hint_counterfactual"] = _flag("hint_counterfactual", raw.get("hint_counterfactual"))
        for key in ("record_rotate_s", "record_key"):
            if raw.get(key) is not None and record is None:
                raise KvPolicyConfigError(f"{key} ({FLAG_OF[key]}) is about a recording: it needs {FLAG_OF['record']} DIR")
        if name is None and path is None and record is None:
            raise KvPolicyConfigError(f"nothing to serve or record: pass {FLAG_OF['config']} PATH, "
                                      f"{FLAG_OF['policy']} NAME or {FLAG_OF['record']} DIR")
        if settings["hint_max_fraction"] is not None and ((name is None and path is None) or mode == "shadow"):
            raise KvPolicyConfigError(f"hint_max_fraction ({FLAG_OF['hint_max_fraction']}) bounds the client hints "
                                      "kvprof's policy honours where it evicts: it needs a policy in enforce mode")
        if settings["hint_counterfactual"] and ((name is None and path is None) or mode == "shadow"):
            raise KvPolicyConfigError(f"hint_counterfactual ({FLAG_OF['hint_counterfactual']}) replays the policy "
                                      "in force without the hints it honours: it needs a policy in enforce mode "
                                      "(shadow mode replays the policy without hints already)")
        name = name or (DEFAULT_POLICY if path is not None else None)
        if name is None:
            if mode == "shadow":
                raise KvPolicyConfigError("shadow mode runs a policy beside vLLM's eviction: pass --kv-policy-config "
                                          "PATH (and --kv-policy NAME for another policy than wa)")
            return cls(policy=None, config=None, mode=mode, record=record, record_key=record_key, **settings)
        from kvprof.policy import POLICIES

        if name in offline:
            raise KvPolicyConfigError(f"policy {name!r} needs the future and cannot serve live traffic")
        hp = sha256 = None
        if path is not None:
            hp, sha256 = load_spec_hp(path)
        elif hasattr(POLICIES[name], "from_hp"):
            raise KvPolicyConfigError(
                f"policy {name!r} needs an hp file: pass --kv-policy-config PATH "
                f"(or additional_config={{'kv_policy': {{'config': PATH}}}})"
            )
        spec = cls(policy=name, config=None if path is None else str(path), hp=hp, keyed_by=POLICIES[name].keyed_by,
                   mode=mode, record=record, record_key=record_key, hp_sha256=sha256, **settings)
        if hp is not None:
            spec.class_names = tuple(hp.table()[0])
        spec.reference_policy()  # fail here, not in the engine core, if the hp file does not fit the policy
        return spec

    def with_hp(self, hp, sha256: str) -> PolicySpec:
        """This spec serving another hp file (a reload of the same path): the same policy, mode and settings.

        Raises
        ------
        KvPolicyConfigError
            The file does not fit the policy.
        """
        spec = dataclasses.replace(self, hp=hp, class_names=tuple(hp.table()[0]), hp_sha256=sha256, _cache={})
        spec.reference_policy()
        return spec

    def check_block_size(self, block_size: int) -> None:
        """Refuse an hp file fitted on other blocks than the server caches, as ``kvprof compare`` of the server's
        recording refuses it (its blocks are the server's): the fit's reuse gaps, depths and tiers count blocks
        of that size.

        Raises
        ------
        KvPolicyConfigError
        """
        fitted = None if self.hp is None else self.hp.block_size
        if fitted is not None and fitted != block_size:
            raise KvPolicyConfigError(
                f"{self.config}: block_size: the hp file was fitted on {fitted}-token blocks, and this server caches "
                f"{block_size}-token blocks (--block-size): fit on a trace of {block_size}-token blocks, such as a "
                "recording of this server (--kv-record), or serve with --block-size "
                f"{fitted}; `kvprof compare` of the recording would refuse the pair for the same reason"
            )

    def reference_policy(self, capacity: int | None = None):
        """A fresh instance of the policy's Python reference for a tier of ``capacity`` blocks
        (for ``wa``'s tuning)."""
        from kvprof.policy import make_policy

        try:
            return make_policy(self.policy, hp=self.hp, capacity=capacity)
        except (ValueError, TypeError) as err:
            raise KvPolicyConfigError(f"cannot build policy {self.policy!r} from {self.config}: {err}") from None

    def make_policy(self, capacity: int | None = None, n_blocks: int = 0):
        """The policy a tier serves with: the compiled twin of :meth:`reference_policy`, its
        tables sized for block ids below ``n_blocks``."""
        from kvprof.core.twin import CompiledTwin

        return CompiledTwin(self.reference_policy(capacity), n_blocks)

    @property
    def counterfactual_replays_policy(self) -> bool:
        """Whether the live counterfactual replays the policy beside LRU: in shadow mode (what it would have
        hit) or with the hint counterfactual (what the policy in force would have hit without the hints)."""
        return self.policy not in (None, "lru") and (self.mode == "shadow" or self.hint_counterfactual)

    def hint_budget(self, n_blocks: int) -> int | None:
        """Retained blocks a hint tag may hold in a cache of ``n_blocks`` usable blocks (None: no budget), as
        ``kvprof compare --hint-max-fraction`` counts them at the capacity it replays a recording with."""
        return None if self.hint_max_fraction is None else int(self.hint_max_fraction * n_blocks)

    @property
    def default_index(self) -> int:
        """The default class's index, or the default cell's for a policy keyed by cells."""
        if self.keyed_by == "cell" and self.hp is not None:
            return len(self.hp.cell_names()) - 1
        return len(self.class_names) - 1

    def describe(self, capacity: int | None = None) -> str:
        """One line for the startup log: what runs, as the pool of ``capacity`` blocks builds it
        (the horizon and first candidate of ``wa`` come from the tuning nearest that size)."""
        if self.policy is None:
            return (f"kvprof: recording to {self.record}{self._keyed_by()}; vLLM's own eviction is unchanged"
                    f"{self._hints(capacity)}")
        src = self.config or "no hp file"
        what = (f"kvprof eviction policy '{self.policy}' {'in force' if self.mode == 'enforce' else 'in shadow mode'} "
                f"from {src}")
        if self.hp is not None:
            reference = self.reference_policy(capacity)
            n = len(self.class_names) - 1
            what += f": {n} fitted classes + default"
            if self.keyed_by == "cell":
                what += f", {len(self.hp.cell_names()) - 1} cells"
            what += f", class rule {self.hp.class_rule.to_dict()}"
            horizon = getattr(reference, "horizon", self.hp.horizon)
            tuned = self.hp.tuned(capacity)
            if capacity is None and self.hp.tuning and hasattr(reference, "order_name"):
                what += (f", horizon and first order from the tuning nearest the cache size "
                         f"({len(self.hp.tuning)} sizes tuned)")
            else:
                what += f", horizon {horizon:g} s"
                if hasattr(reference, "order_name"):
                    what += f", starting on order '{reference.order_name}'"
                    what += f" (tuned for {tuned['capacity']} blocks)" if tuned else " (not tuned: fitted defaults)"
            what += f", sha256 {self.hp_sha256[:12]}"
        if self.mode == "shadow":
            what += "; vLLM's own eviction is unchanged"
        if self.record:
            what += f"; recording to {self.record}{self._keyed_by()}"
        return what + self._hints(capacity)

    def _hints(self, capacity: int | None) -> str:
        """What the server does with client hints: only kvprof's policy in force honours them."""
        if self.policy is None or self.mode == "shadow":
            recorded = " and recorded" if self.record else ""
            return (f"; client hints are checked{recorded}, not honoured by the GPU tier (vLLM's own eviction "
                    "takes none)")
        if self.hint_max_fraction is None:
            return "; client hints honoured, no budget"
        from kvprof.limits import usable_blocks

        budget = "" if capacity is None else f" ({self.hint_budget(usable_blocks(capacity))} blocks)"
        return (f"; client hints honoured, retaining at most {self.hint_max_fraction:g} of the cache{budget}, "
                "per hint tag and in all")

    def _keyed_by(self) -> str:
        return f" (block ids keyed by the shared {self.record_key})" if self.record_key else ""

    def class_name(self, extra_args: dict | None) -> str | None:
        """The workload class a request's ``extra_args`` name, or None when untagged."""
        if not extra_args:
            return None
        name = extra_args.get("workload")
        if name is not None and name != "":
            return str(name)
        if self.hp is None:
            return None
        from kvprof.classes import workload_class

        rule = self.hp.class_rule
        value = extra_args.get(rule.field) if rule.field else None
        type_name = extra_args.get("type")
        if type_name is None and value is None:
            return None
        turn = extra_args.get("turn")
        try:
            turn = None if turn is None else int(turn)
        except (TypeError, ValueError):
            turn = None
        return workload_class(rule, None if type_name is None else str(type_name), turn, value)

    def class_index(self, extra_args: dict | None, prompt_tokens: int = 0) -> int:
        """What the policy is told a request's workload is: the index of its class in the policy's
        table, or for a policy keyed by cells its cell's; the default when untagged or unknown."""
        if self.hp is None:
            return 0
        by_rule = self.keyed_by == "cell" and self.hp.cell_rule is not None  # the prompt's length matters
        args = extra_args or {}
        key = (args.get("workload"), args.get("type"), args.get("turn"),
               args.get(self.hp.class_rule.field) if self.hp.class_rule.field else None,
               *(args.get(name) for name in (self.hp.cell_rule.fields if by_rule else ())),
               prompt_tokens if by_rule else 0)
        try:
            return self._cache[key]
        except (KeyError, TypeError):
            pass
        name = self.class_name(extra_args)
        if self.keyed_by == "cell":
            index = self._cell_index(name, args, prompt_tokens)
        else:
            index = self.default_index if name is None else self.hp.index_of(name)
        try:
            if len(self._cache) < 4096:
                self._cache[key] = index
        except TypeError:
            pass
        return index

    def _cell_index(self, class_name: str | None, extra_args: dict, prompt_tokens: int) -> int:
        """The cell of a request of ``class_name`` (None: untagged) under the hp file's cell rule."""
        hp = self.hp
        if class_name in hp.cell_names()[:-1]:  # a tag may name a cell directly
            return hp.cell_index(class_name)
        rule = hp.cell_rule
        if rule is None:  # each class is a cell
            return self.default_index if class_name is None else hp.cell_index(class_name)
        from kvprof.cells import request_features

        turn = extra_args.get("turn")
        try:
            turn = None if turn is None else int(turn)
        except (TypeError, ValueError):
            turn = None
        features = request_features(class_name or "", turn, prompt_tokens,
                                    {name: extra_args.get(name) for name in rule.fields})
        return hp.cell_index(rule.names[rule.cell_of(features)])


def load_spec_hp(path):
    """The hp file at ``path`` for serving, and the sha256 of the bytes it was loaded from.

    The file is read once (so the digest is of what was loaded) and must be a regular file: kvprof
    reads it where vLLM starts, again in every engine core and at every reload, which a pipe or a
    FIFO cannot serve (and opening a FIFO with no writer would block the start-up).

    Raises
    ------
    KvPolicyConfigError
        Any loader error, with its location; a path that is not a regular file.
    """
    import hashlib

    from kvprof.errors import HpFileError
    from kvprof.jsonfile import parse_json
    from kvprof.models.hp import HpFile

    try:
        raw = _read_regular_file(path)
        return HpFile.from_dict(parse_json(raw, path, HpFileError), path=str(path)), hashlib.sha256(raw).hexdigest()
    except HpFileError as err:
        raise KvPolicyConfigError(f"cannot use hp file: {err}") from None
    except OSError as err:
        raise KvPolicyConfigError(f"cannot use hp file {path}: {err.strerror or err}") from None


def _read_regular_file(path) -> bytes:
    """The bytes of ``path``, opened without blocking; refused unless it is a regular file."""
    import os
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO or pipe" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket")
            raise KvPolicyConfigError(
                f"cannot use hp file {path}: it is {kind}, not a regular file (kvprof reads it at start-up, "
                "in every engine core and at each reload): write it to a file and pass that path")
        return handle.read()


def _path(raw: dict, key: str) -> str | None:
    """``raw[key]`` as a path: None when absent, else non-empty text without a NUL byte."""
    value = raw.get(key)
    if value is not None and (type(value) is not str or not value or "\0" in value):
        raise KvPolicyConfigError(f"{key} ({FLAG_OF[key]}) must be a path (non-empty, no NUL byte), "
                                  f"got {_shown(value)}")
    return value


def _choice(raw: dict, key: str, options, *refused_later: str) -> str | None:
    """``raw[key]``: None when absent, else one of ``options`` (or of ``refused_later``, which the
    caller refuses with a message of its own)."""
    value = raw.get(key)
    if value is None or (type(value) is str and value in (*options, *refused_later)):
        return value
    if key == "policy" and type(value) is str and value:
        raise KvPolicyConfigError(f"unknown policy {_shown(value)}; live policies: {', '.join(options)}")
    raise KvPolicyConfigError(f"{key} ({FLAG_OF[key]}) must be one of {', '.join(options)}, got {_shown(value)}")


def _seconds(key: str, value, setting: Seconds) -> float:
    """``value`` (a number, or its ASCII text from the command line) checked against ``setting``."""
    if value is None:
        return setting.default
    rule = ("0 (off) or " if setting.zero_is_off else "") + setting.bound.describe()
    try:
        number = SECONDS.parse(value)
        if not (number == 0 and setting.zero_is_off):
            setting.bound.check(number)
    except ValueError:
        raise KvPolicyConfigError(f"{key} ({FLAG_OF[key]}) must be {rule} seconds, got {_shown(value)}") from None
    return float(number)


def _flag(key: str, value) -> bool:
    """``value``, true or false (a JSON boolean; the flag given on the command line is True); absent: False."""
    if value is None:
        return False
    if type(value) is not bool:
        raise KvPolicyConfigError(f"{key} ({FLAG_OF[key]}) must be true or false, got {_shown(value)}")
    return value


def _share(key: str, value) -> float | None:
    """``value``, a share in (0, 1] (a number, or its ASCII text from the command line); absent: None."""
    if value is None:
        return None
    from kvprof.models.retention import SHARE

    try:
        return float(SHARE.parse(value))
    except ValueError:
        raise KvPolicyConfigError(f"{key} ({FLAG_OF[key]}) must be {SHARE.describe()}, got {_shown(value)}") from None


#: Token ids are below this (vocabularies are far smaller; vLLM keeps ids as 32-bit ints).
_TOKEN_ID_LIMIT = 2**31


def _token_ids(key: str, value) -> frozenset[int]:
    """``value``, token ids as a list of ints or their comma-separated ASCII text (the command line), as a
    set; absent: empty."""
    if value is None:
        return frozenset()
    items = value.split(",") if type(value) is str else value
    ids = []
    if isinstance(items, (list, tuple)) and items:
        for item in items:
            text = item.strip() if type(item) is str else None
            number = int(text) if text is not None and text.isascii() and text.isdigit() else item
            if type(number) is not int or not 0 <= number < _TOKEN_ID_LIMIT:
                break
            ids.append(number)
        else:
            return frozenset(ids)
    raise KvPolicyConfigError(f"{key} ({FLAG_OF[key]}) must be token ids, comma-separated integers in "
                              f"[0, {_TOKEN_ID_LIMIT}), got {_shown(value)}")


def check_tool_call_tokens(tool_call_tokens: frozenset[int], vocab_size: int | None) -> None:
    """Refuse tool-call token ids the model's vocabulary (``vocab_size`` ids; None: unknown) does not hold:
    no response could contain one, so every stopped response would read as an end of turn.

    Raises
    ------
    KvPolicyConfigError
    """
    beyond = sorted(token for token in tool_call_tokens if vocab_size is not None and token >= vocab_size)
    if beyond:
        raise KvPolicyConfigError(f"tool_call_tokens ({FLAG_OF['tool_call_tokens']}) {', '.join(map(str, beyond))} "
                                  f"beyond the model's vocabulary of {vocab_size} token ids: no response could hold "
                                  "them (ids of another model's tokenizer?)")


def request_extra_args(request) -> dict | None:
    """``SamplingParams.extra_args`` of a vLLM ``Request`` (None for pooling requests or untagged)."""
    params = getattr(request, "sampling_params", None)
    return getattr(params, "extra_args", None) if params is not None else None

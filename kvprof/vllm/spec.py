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
        "reload_interval_s": 10,      # [--kv-policy-reload-interval] re-read a changed hp file; 0: never
        "log_interval_s": 300,        # [--kv-log-interval] seconds between hit-ratio log lines; 0: never
    }}

``policy`` defaults to ``wa`` when ``config`` is given; a policy that needs no hp file (``lru``,
``lfu``, ``s3fifo``, ``arc``) may omit ``config``. ``record`` alone records and leaves vLLM's
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
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvprof.errors import KvprofError

#: Key of ``additional_config`` that holds kvprof's settings.
CONFIG_KEY = "kv_policy"
DEFAULT_POLICY = "wa"
#: vLLM releases the adaptor was built against: 0.30 <= version < 0.34.
SUPPORTED = ((0, 30), (0, 34))
MODES = ("enforce", "shadow")
#: Numeric settings: name -> (default, whether 0 is allowed: "off").
_SECONDS = {"record_rotate_s": (3600.0, False), "reload_interval_s": (10.0, True), "log_interval_s": (300.0, True)}
_KEYS = ("config", "policy", "mode", "record", *_SECONDS)


class KvPolicyConfigError(KvprofError, ValueError):
    """The ``kv_policy`` configuration cannot be served; vLLM must not start with it."""

    def __init__(self, message: str):
        super().__init__(f"kvprof kv_policy: {message}")


class ChangedWhileRead(KvPolicyConfigError):
    """The hp file was replaced while it was read; read it again."""


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
    record_rotate_s, reload_interval_s, log_interval_s : float
        See the module's configuration; 0 turns reloading or logging off.
    """

    policy: str | None
    config: str | None
    hp: Any = None
    class_names: tuple[str, ...] = ("<default>",)
    keyed_by: str = "class"
    mode: str = "enforce"
    record: str | None = None
    record_rotate_s: float = 3600.0
    reload_interval_s: float = 10.0
    log_interval_s: float = 300.0
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
        path, record = raw.get("config"), raw.get("record")
        for key, value in (("config", path), ("record", record)):
            if value is not None and (not isinstance(value, str) or not value):
                raise KvPolicyConfigError(f"{key} must be a path, got {value!r:.80}")
        name = raw.get("policy") or (DEFAULT_POLICY if path is not None or record is None else None)
        mode = raw.get("mode") or "enforce"
        if mode not in MODES:
            raise KvPolicyConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r:.80}")
        seconds = {key: _seconds(key, raw.get(key), default, zero) for key, (default, zero) in _SECONDS.items()}
        if name is None:
            if mode == "shadow":
                raise KvPolicyConfigError("shadow mode runs a policy beside vLLM's eviction: pass --kv-policy-config "
                                          "PATH (and --kv-policy NAME for another policy than wa)")
            return cls(policy=None, config=None, mode=mode, record=record, **seconds)
        from kvprof.policy import POLICIES

        live = [known for known in POLICIES if known != "belady"]
        if name == "belady":
            raise KvPolicyConfigError("policy 'belady' needs the future and cannot serve live traffic")
        if name not in live:
            raise KvPolicyConfigError(f"unknown policy {name!r:.80}; live policies: {', '.join(live)}")
        hp = sha256 = None
        if path is not None:
            hp, sha256 = load_spec_hp(path)
        elif hasattr(POLICIES[name], "from_hp"):
            raise KvPolicyConfigError(
                f"policy {name!r} needs an hp file: pass --kv-policy-config PATH "
                f"(or additional_config={{'kv_policy': {{'config': PATH}}}})"
            )
        spec = cls(policy=name, config=None if path is None else str(path), hp=hp, keyed_by=POLICIES[name].keyed_by,
                   mode=mode, record=record, hp_sha256=sha256, **seconds)
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
    def default_index(self) -> int:
        """The default class's index, or the default cell's for a policy keyed by cells."""
        if self.keyed_by == "cell" and self.hp is not None:
            return len(self.hp.cell_names()) - 1
        return len(self.class_names) - 1

    def describe(self, capacity: int | None = None) -> str:
        """One line for the startup log: what runs, as the pool of ``capacity`` blocks builds it
        (the horizon and first candidate of ``wa`` come from the tuning nearest that size)."""
        if self.policy is None:
            return f"kvprof: recording to {self.record}; vLLM's own eviction is unchanged"
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
            what += f"; recording to {self.record}"
        return what

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

    Raises
    ------
    KvPolicyConfigError
        Any loader error, with its location.
    """
    import hashlib

    from kvprof.errors import HpFileError
    from kvprof.models.hp import load_hp

    try:
        before = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        hp = load_hp(path)
        after = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except HpFileError as err:
        raise KvPolicyConfigError(f"cannot use hp file: {err}") from None
    except OSError as err:
        raise KvPolicyConfigError(f"cannot use hp file {path}: {err.strerror or err}") from None
    if before != after:  # written while it was read: the digest may not be of what was loaded
        raise ChangedWhileRead(f"cannot use hp file {path}: it changed while it was read")
    return hp, after


def _seconds(key: str, value, default: float, zero_allowed: bool) -> float:
    if value is None:
        return default
    allowed = "from 0 (off) to 1e9" if zero_allowed else "above 0 and at most 1e9"
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < 0 or (value == 0 and not zero_allowed) or value > 10**9):
        raise KvPolicyConfigError(f"{key} must be a number of seconds {allowed}, got {value!r:.80}")
    return float(value)


def request_extra_args(request) -> dict | None:
    """``SamplingParams.extra_args`` of a vLLM ``Request`` (None for pooling requests or untagged)."""
    params = getattr(request, "sampling_params", None)
    return getattr(params, "extra_args", None) if params is not None else None

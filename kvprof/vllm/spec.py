"""What ``additional_config["kv_policy"]`` means: parsing, validation and request classes.

This module does not import vLLM, so it is shared by the plugin (API-server side, where the
configuration is checked before the engine starts) and the engine core (where the block pool is
built), and can be tested without vLLM.

The configuration::

    additional_config = {"kv_policy": {"config": "hp.json", "policy": "wa"}}

``config`` is a kvprof hyperparameter file (``kvprof fit``), ``policy`` a name of
:data:`kvprof.policy.POLICIES` (default ``wa``). A policy that needs no hp file (``lru``) may omit
``config``. Anything wrong -- unknown keys, a missing or invalid file, an unknown policy -- raises
:class:`KvPolicyConfigError`; there is no silent fall-back to vLLM's LRU.

Requests name their workload in ``SamplingParams.extra_args`` (the OpenAI server fills it from
``vllm_xargs``): either ``{"workload": "text_2"}`` or the trace fields ``{"type": "text", "turn": 2}``
(plus the keyed field when the hp file's class rule is ``field``, and the fields its cell rule
reads), classified with the hp file's class rule by :func:`kvprof.classes.workload_class` and,
for policies keyed by cells (``wa``), placed in a cell by its cell rule with the prompt's length,
exactly as the profiler did. Untagged requests get the default class (and the cell the rule
gives a request of no class).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvprof.errors import KvprofError

#: Key of ``additional_config`` that holds kvprof's settings.
CONFIG_KEY = "kv_policy"
DEFAULT_POLICY = "wa"
#: vLLM releases the adaptor was built against: 0.30 <= version < 0.34.
SUPPORTED = ((0, 30), (0, 34))
_KEYS = {"config", "policy"}


class KvPolicyConfigError(KvprofError, ValueError):
    """The ``kv_policy`` configuration cannot be served; vLLM must not start with it."""

    def __init__(self, message: str):
        super().__init__(f"kvprof kv_policy: {message}")


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
    policy : str
        Policy name (a key of :data:`kvprof.policy.POLICIES`).
    config : str or None
        Path of the hp file.
    hp : kvprof.models.hp.HpFile or None
    class_names : tuple of str
        Class names in the policy's index order, the default last (``HpFile.table()``).
    keyed_by : {"class", "cell"}
        What the policy's ``access`` is told (its class ``keyed_by``).
    """

    policy: str
    config: str | None
    hp: Any = None
    class_names: tuple[str, ...] = ("<default>",)
    keyed_by: str = "class"
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
            raise KvPolicyConfigError(f"expected an object {{'config': PATH, 'policy': NAME}}, got {raw!r}")
        unknown = set(raw) - _KEYS
        if unknown:
            raise KvPolicyConfigError(f"unknown key(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
        name = raw.get("policy") or DEFAULT_POLICY
        path = raw.get("config")
        from kvprof.policy import POLICIES

        if name not in POLICIES:
            raise KvPolicyConfigError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}")
        if name == "belady":
            raise KvPolicyConfigError("policy 'belady' needs the future and cannot serve live traffic")
        hp = None
        if path is not None:
            from kvprof.errors import HpFileError
            from kvprof.models.hp import load_hp

            try:
                hp = load_hp(path)
            except HpFileError as err:
                raise KvPolicyConfigError(f"cannot use hp file: {err}") from None
        elif hasattr(POLICIES[name], "from_hp"):
            raise KvPolicyConfigError(
                f"policy {name!r} needs an hp file: pass --kv-policy-config PATH "
                f"(or additional_config={{'kv_policy': {{'config': PATH}}}})"
            )
        spec = cls(policy=name, config=None if path is None else str(path), hp=hp, keyed_by=POLICIES[name].keyed_by)
        if hp is not None:
            spec.class_names = tuple(hp.table()[0])
        spec.reference_policy()  # fail here, not in the engine core, if the hp file does not fit the policy
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

    def describe(self) -> str:
        """One line for the startup log."""
        src = self.config or "no hp file"
        n = len(self.class_names) - 1
        rule = self.hp.class_rule.to_dict() if self.hp is not None else None
        cells = f", {len(self.hp.cell_names()) - 1} cells" if self.keyed_by == "cell" and self.hp is not None else ""
        return (
            f"kvprof eviction policy '{self.policy}' in force from {src}: {n} fitted classes + default{cells}"
            + (f", class rule {rule}, horizon {self.hp.horizon:g} s" if rule else "")
        )

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


def request_extra_args(request) -> dict | None:
    """``SamplingParams.extra_args`` of a vLLM ``Request`` (None for pooling requests or untagged)."""
    params = getattr(request, "sampling_params", None)
    return getattr(params, "extra_args", None) if params is not None else None

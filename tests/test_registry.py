"""The policy registry: every registered policy has its reference class, its compiled twin, a
differential test and its doc lines, and everything derived from the registry agrees with it."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from kvprof import registry
from kvprof.core import TWIN_CLASSES
from kvprof.models.hp import CANDIDATES
from kvprof.policy import POLICIES, REGISTERED, live_policies, reference_class

REPO = Path(__file__).resolve().parent.parent
NAMES = [r.name for r in registry.REGISTERED]
#: The compiled protocol: every kind is dispatched in each of these (``kvprof/core/dispatch.py``).
DISPATCHED = ("free_kind_n", "evict_kind_n")
#: The modules written out by a generator (each test of it keeps it equal to what generates it).
GENERATED = ("kvprof/core/copiers.py", "kvprof/core/dispatch.py")


def registration(name: str) -> registry.Registration:
    return next(r for r in registry.REGISTERED if r.name == name)


def test_names_are_unique():
    assert len(set(NAMES)) == len(NAMES), f"a name is registered twice: {NAMES}"


@pytest.mark.parametrize("name", NAMES)
def test_a_registered_policy_has_its_reference_class(name):
    r = registration(name)
    cls = reference_class(r)
    assert cls.name == name, f"{r.reference} is registered as {name!r} but its class says name = {cls.name!r}"
    assert r.needs_hp == hasattr(cls, "from_hp"), (
        f"registration {name!r}: needs_hp={r.needs_hp} but {r.reference} {'has' if hasattr(cls, 'from_hp') else 'lacks'} "
        "from_hp; kvprof/registry.py must say what the class does")
    assert r.offline == cls.offline, f"registration {name!r}: offline={r.offline}, the class says {cls.offline}"


@pytest.mark.parametrize("name", NAMES)
def test_a_registered_policy_has_a_compiled_twin(name):
    r = registration(name)
    path = REPO / "kvprof" / "core" / "kinds" / f"{r.twin}.py"
    assert path.exists(), (f"policy {name!r} is registered with twin {r.twin!r} but {path.relative_to(REPO)} does not "
                           "exist: write its compiled twin there (docs/adding-a-policy.md, step 2)")
    kind = importlib.import_module(f"kvprof.core.kinds.{r.twin}")
    missing = [attr for attr in ("FIELDS", "lists") if not hasattr(kind, attr)]
    assert not missing, f"kvprof/core/kinds/{r.twin}.py lacks {', '.join(missing)} (docs/adding-a-policy.md, step 2)"
    from kvprof.core import dispatch

    for operation in DISPATCHED:
        source = inspect.getsource(getattr(dispatch, operation).py_func)
        assert f"{r.twin}." in source, (f"kvprof/core/dispatch.py's {operation} does not dispatch kind {r.twin!r} "
                                        f"(policy {name!r}): run `python -m kvprof.core.dispatch`")
    assert REGISTERED[name] in TWIN_CLASSES


def test_the_dispatch_module_is_what_the_registry_and_the_kinds_generate():
    """kvprof.core.dispatch is written out so numba can cache it: a kind registered, or an operation
    added to one, without writing it again would go undispatched (``python -m kvprof.core.dispatch``)."""
    from kvprof.core import dispatch
    from kvprof.core.kinds import dispatch_source

    assert Path(dispatch.__file__).read_text() == dispatch_source(), \
        "kvprof/core/dispatch.py is stale: run `python -m kvprof.core.dispatch` and commit it"


def test_a_policy_is_named_by_its_class_its_twin_and_its_registration_alone():
    """Adding a policy is three files (docs/adding-a-policy.md): SIEVE, added by following it, is named
    nowhere else in the package save the generated modules."""
    naming = sorted(str(path.relative_to(REPO)) for path in (REPO / "kvprof").rglob("*.py")
                    if re.search(r"\bsieve", path.read_text(), re.IGNORECASE))
    assert [path for path in naming if path not in GENERATED] == [
        "kvprof/core/kinds/sieve.py", "kvprof/policy/sieve.py", "kvprof/registry.py"], (
        "a policy must be named only by its reference class, its twin and its registration: "
        "derive the rest from kvprof/registry.py")


@pytest.mark.parametrize("name", NAMES)
def test_a_registered_policy_has_a_differential_test(name):
    from tests.test_core_policies import BUILDERS

    tested = name in BUILDERS or any(label.startswith(f"{name} ") for label in BUILDERS)
    assert tested, (f"policy {name!r} has no differential test: tests/test_core_policies.py's BUILDERS must build it "
                    "(every policy of POLICIES is there; add one for a policy built by another)")


@pytest.mark.parametrize("name", NAMES)
def test_a_registered_policy_has_its_doc_lines(name):
    r = registration(name)
    assert r.summary and "\n" not in r.summary, f"registration {name!r} needs a one-line summary in kvprof/registry.py"
    cls = REGISTERED[name]
    assert inspect.getdoc(cls), f"{r.reference} needs a docstring saying what it keeps and evicts"
    if r.by_name:
        module = r.reference.partition(":")[0]
        line = f"[`{name}`](kvprof/policy/{module}.py)"
        assert line in (REPO / "README.md").read_text(), (
            f"README.md's policy list lacks a line for {name!r}: add `- {line}: {r.summary}.`")


def test_what_is_derived_from_the_registry_agrees_with_it():
    assert list(POLICIES) == [r.name for r in registry.by_name()]
    assert live_policies() == [r.name for r in registry.by_name() if not r.offline]
    assert CANDIDATES[-len(registry.candidates()):] == registry.candidates()
    from kvprof.vllm.spec import policy_help

    assert all(name in policy_help() for name in live_policies())
    assert "belady" not in policy_help()


"""Every eviction policy kvprof knows, registered once: its name, reference class, compiled twin, doc line.

A policy is three files, this one included: its reference class (``kvprof/policy/<module>.py``),
its compiled twin (``kvprof/core/kinds/<twin>.py``) and a :class:`Registration` in
:data:`REGISTERED` (docs/adding-a-policy.md walks through it). Everything else is derived from
this table: the command-line names and the classes :mod:`kvprof.policy` exports
(:data:`kvprof.policy.POLICIES`, every CLI's choices), the policies a vLLM server can run and the
plugin's help text, the twin tables and kind numbers of :mod:`kvprof.core` and its compiled
dispatch (``kvprof/core/dispatch.py``, generated), and ``wa``'s followed candidates
(:data:`kvprof.models.hp.CANDIDATES`).

The table is plain data (no imports) so that every layer may read it, :mod:`kvprof.models`
included; :func:`kvprof.policy.reference_class` imports a registration's class.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Registration:
    """One policy: how it is named, where its reference and twin live, how it is offered.

    Invariant (``tests/test_registry.py``): ``reference`` names a class of ``kvprof.policy``
    whose ``name`` is ``name``; ``twin`` is a module of ``kvprof.core.kinds`` with a differential
    test; ``summary`` is one line; ``needs_hp`` and ``offline`` say what the class says (kept here
    so that the vLLM plugin's help, built at every server start, needs no policy imported).
    """

    #: Name on the command line, in results and in ``kv_policy.policy`` (the class's ``name``).
    name: str
    #: ``"module:Class"`` of the reference class under ``kvprof.policy``.
    reference: str
    #: Module of ``kvprof.core.kinds`` that runs it compiled (several policies may share one).
    twin: str
    #: One line for the help texts and the policy lists: what the policy evicts first.
    summary: str
    #: Offered by name (``kvprof compare --policies``, ``--kv-policy``). False for a policy built
    #: only by another one (``learned``: ``wa``'s candidate, made from the hp file's predictor).
    by_name: bool = True
    #: ``wa`` keeps it in step as a followed candidate and follows it when its shadow hits most.
    candidate: bool = False
    #: Built from an hp file (the class has ``from_hp``): a server needs ``--kv-policy-config``.
    needs_hp: bool = False
    #: Needs the future (the class's ``offline``): the simulator's yardstick, never served.
    offline: bool = False


#: Registration order is the order of the command-line lists and of the kind numbers.
REGISTERED: tuple[Registration, ...] = (
    Registration("lru", "lru:LRUPolicy", "lru", "least recently freed first: vLLM's own free-queue order"),
    Registration("wa", "wa:WorkloadAwarePolicy", "classed",
                 "kvprof's workload-aware policy: the fitted reuse model, with shadows of candidate orders",
                 needs_hp=True),
    Registration("wa-paper", "wa_paper:PublishedWorkloadAwarePolicy", "classed",
                 "the published workload-aware score per class (type x turn)", needs_hp=True),
    Registration("lfu", "lfu:LFUPolicy", "lfu", "fewest hits first, least recently freed among equals"),
    Registration("s3fifo", "s3fifo:S3FIFOPolicy", "s3fifo",
                 "S3-FIFO (SOSP '23): a small FIFO filters one-hit blocks, a main FIFO, a ghost", candidate=True),
    Registration("arc", "arc:ARCPolicy", "arc", "ARC: recency and frequency lists balanced by their ghosts"),
    Registration("belady", "belady:BeladyPolicy", "belady",
                 "Belady's MIN: the farthest next use first (offline, the simulator's ceiling)", offline=True),
    Registration("learned", "learned:LearnedPolicy", "learned",
                 "buckets of a fitted logistic predictor of reuse (wa's learned candidate)", by_name=False,
                 candidate=True),
    Registration("sieve", "sieve:SIEVEPolicy", "sieve",
                 "SIEVE (NSDI '24): one FIFO, a visited bit, a hand that sweeps from the oldest"),
    Registration("long-output", "long_output:LongOutputLRU", "long_output",
                 "LRU, the blocks of requests with outputs over a tuned limit first (wa's long-output candidate)",
                 by_name=False, candidate=True),
    Registration("first-turn", "first_turn:FirstTurnLRU", "first_turn",
                 "LRU, the blocks of requests that began a session (inferred from the chains) first", candidate=True),
    Registration("finish-reason", "finish_reason:FinishReasonLRU", "finish_reason",
                 "LRU, the blocks of requests whose response ended the turn (not a tool call) first", candidate=True),
)


def by_name() -> tuple[Registration, ...]:
    """The registrations offered by name, in registration order."""
    return tuple(r for r in REGISTERED if r.by_name)


def live() -> tuple[Registration, ...]:
    """The registrations a live server can run: offered by name, not needing the future."""
    return tuple(r for r in by_name() if not r.offline)


def candidates() -> tuple[str, ...]:
    """Names of the policies ``wa`` follows as candidates, in registration order."""
    return tuple(r.name for r in REGISTERED if r.candidate)


def twins() -> tuple[str, ...]:
    """The twin modules, each once, in registration order: a twin's kind number is its index."""
    return tuple(dict.fromkeys(r.twin for r in REGISTERED))

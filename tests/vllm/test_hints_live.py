"""Client hints through vLLM: the pool honours them as the simulator's hint layer does, and a server
takes them from ``vllm_xargs``, refuses a malformed one with a 400 naming the field, records them,
and caches what ``kvprof compare --hints trace`` of its own recording predicts."""

from __future__ import annotations

import math
import random

import pytest

pytestmark = pytest.mark.vllm


def _cache(pool, block, key: bytes) -> None:
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    pool._insert_block_hash(make_block_hash_with_group_id(key, 0), block, num_tokens=16)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_pool_evicts_as_the_hinted_reference(seed, in_vllm):
    """kvprof's pool serving ``lru``, its requests freed with random hints (retain, release, none, some
    naming one of three sessions) under a budget, hands out the blocks that ``HintedPolicy`` over the
    reference ``lru`` evicts, on the same operations and clock; prefix hits on released and retained
    blocks go through the layer, and both judge the releases alike (evictions without a hint held
    bypass the pool's layer)."""
    if not in_vllm:
        return
    from kvprof.models.hints import Hint
    from kvprof.policy import make_policy
    from kvprof.policy.hinted import HintedPolicy
    from kvprof.vllm.block_pool import KvprofBlockPool
    from kvprof.vllm.spec import PolicySpec

    rng = random.Random(seed)
    n = 48
    now = [0.0]
    spec = PolicySpec.from_additional_config({"kv_policy": {"policy": "lru", "hint_max_fraction": 0.125}})
    pool = KvprofBlockPool(num_gpu_blocks=n, enable_caching=True, hash_block_size=16, kvprof_spec=spec,
                           clock=lambda: now[0])
    reference = HintedPolicy(make_policy("lru"), budget_blocks=spec.hint_budget(n - 1))  # less the null block
    queue = pool.free_block_queue
    cached: set[int] = set()  # blocks with a hash the reference holds (held or evictable)
    evictable: set[int] = set()
    running: list[list] = []
    choices = [None, None, Hint(retain_s=2.0, tag=1), Hint(retain_s=6.0, priority=10), Hint(release=True),
               *(Hint(release=True, session=s) for s in range(3)), *(Hint(session=s) for s in range(3))]
    key = 0
    for step in range(500):
        now[0] += rng.choice([0.0, 0.1, 0.5, 1.5])
        if rng.random() < 0.5 and pool.get_num_free_blocks() > 6:
            hits = rng.sample(sorted(evictable), min(len(evictable), rng.randint(0, 3)))
            pool.touch([pool.blocks[i] for i in hits])
            for block in hits:
                reference.remove(block)
                reference.access(block, now[0], hit=True)
            evictable -= set(hits)
            k = min(rng.randint(1, 5), pool.get_num_free_blocks())
            expected = reference.evict_n(min(k - pool.free_block_queue._front.size, len(reference)), now[0]) \
                if k > pool.free_block_queue._front.size else []
            fresh = pool.get_new_blocks(k)
            victims = [b.block_id for b in fresh if b.block_id in cached]
            assert victims == expected, f"step {step}"
            cached -= set(victims)
            evictable -= set(victims)
            for block in fresh[: rng.randint(0, k)]:
                key += 1
                _cache(pool, block, key.to_bytes(8, "little"))
                pool.policy.access(block.block_id, now[0], hit=False)
                if queue.hints.tracks_sessions:  # as the pool's cache_full_blocks tells it
                    queue.hints.recached(block.block_id)
                reference.access(block.block_id, now[0], hit=False)
                cached.add(block.block_id)
            running.append([pool.blocks[i] for i in hits] + fresh)
        elif running:
            blocks = running.pop(rng.randrange(len(running)))
            hint = rng.choice(choices)
            held = [b.block_id for b in blocks]
            if queue.hints.tracks(None if hint is None else hint.session):  # as the pool's finish_request
                queue.hints.note_held(held, hint.session if hint else None, now[0])
            reference.finish(step, now[0], hint=hint, held=held)
            queue.set_hint(hint)
            pool.free_blocks(reversed(blocks))
            queue.set_hint(None)
            freed = [b.block_id for b in reversed(blocks) if b.block_id in cached and b.ref_cnt == 0]
            if freed:  # a free of no cached block does not reach the policy
                reference.free(freed, now[0])
            evictable |= set(freed)
        assert len(queue.hints) == len(reference)
        assert (queue.hints.n_released, queue.hints.n_retained) == (reference.n_released, reference.n_retained)
    assert queue.hints.counters == reference.counters
    assert queue.hints._holders == reference._holders
    for record in ("released_record", "evicted_record"):
        pool_side, reference_side = getattr(queue.hints, record), getattr(reference, record)
        assert (pool_side.returned, pool_side.stayed_away) == (reference_side.returned, reference_side.stayed_away)
    assert reference.evicted_record.returned + reference.evicted_record.stayed_away
    assert reference.released_record.returned + reference.released_record.stayed_away
    assert queue.hint_horizon() == reference.horizon.seconds(len(reference), now[0]) < math.inf
    assert reference.counters.retained_hits and reference.counters.released_evicted and reference.counters.over_budget
    order = [b.block_id for b in queue.get_all_free_blocks() if b.block_id in cached]
    assert order == reference.order(now[0])


# --- a real server --------------------------------------------------------------------------------

def _hint_of(k: int) -> dict:
    """Prompt ``k``'s hint: every fourth retained (tag 1), the next released, the others none."""
    return [{"retain_s": 1000, "hint_tag": 1}, {"release": True}, {}, {}][k % 4]


#: Two sessions read one document (two blocks of 32 tokens), each with a block of its own after it.
DOCUMENT = [16] + [(11 * i) % 400 + 20 for i in range(63)]
OWN = {"A": [(5 * i + 1) % 400 + 20 for i in range(32)] + [21, 22, 23, 24],
       "B": [(3 * i + 2) % 400 + 20 for i in range(32)] + [25, 26, 27, 28]}


def _sends() -> list[tuple[str, list[int], dict]]:
    """``(label, prompt, vllm_xargs)`` in the order sent: twelve prompts of three full blocks, twice; before
    them a request naming a session (sessions are tracked from its finish on), then session A reads the
    document, B reads it, and A reads it again and releases; B reads it once more after four more prompts,
    whose blocks evict the released ones: A's own block, not the document B shares."""
    main = [(f"prompt {k}", [3 + k] + [(7 * i + 13 * k) % 400 + 20 for i in range(99)], _hint_of(k))
            for k in list(range(12)) * 2]
    return [("first session", [17] + [30] * 39, {"hint_session": "warm-up"}),
            ("A", DOCUMENT + OWN["A"], {"hint_session": "A"}),
            ("B", DOCUMENT + OWN["B"], {"hint_session": "B"}),
            ("A ends", DOCUMENT + OWN["A"], {"hint_session": "A", "release": True}),
            *main[:4],
            ("B again", DOCUMENT + OWN["B"], {"hint_session": "B"}),
            *main[4:]]


#: The hint budget served and replayed: 8 of the 15 usable blocks, where tag 1 asks to retain 9 (three
#: prompts of three blocks); counted over the 16 blocks with the null block it would be 9, all retained,
#: and the live hits would differ from the replay's (288 tokens against 192 on the recording measured).
BUDGET = "0.5625"


def _served(vllm_venv, tiny_model, tmp, *flags: str) -> dict:
    """``vllm serve *flags --kv-record --kv-hint-max-fraction BUDGET`` sent :func:`_sends`, with two malformed
    hints in between: the prompt tokens each found cached (by label), the answers to the malformed ones, and
    /metrics at the end."""
    import time
    import urllib.request

    from vllm_support import post_completion, vllm_server

    rec = tmp / "rec"
    cached, refused = [], []
    with vllm_server(vllm_venv, tiny_model, *flags, "--kv-record", str(rec), "--kv-hint-max-fraction", BUDGET,
                     log=tmp / "serve.log") as url:
        for n, (label, prompt, xargs) in enumerate(_sends()):
            if n == 10:
                for bad in ({"retain_priority": 500}, {"retain_s": "soon", "workload": "text_1"}):
                    refused.append(post_completion(url, {"model": "tiny", "prompt": [5] * 40, "max_tokens": 1,
                                                         "vllm_xargs": bad}))
            status, body = post_completion(url, {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                 "temperature": 0.0, **({"vllm_xargs": xargs} if xargs else {})})
            assert status == 200, body
            cached.append((label, (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
        time.sleep(2.5)  # a metrics snapshot and a closed frame of the recording
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
    time.sleep(3)  # the guard finishes the recording after the engine core went
    return {"rec": rec, "cached": cached, "refused": refused, "metrics": metrics, "tmp": tmp, "venv": vllm_venv}


@pytest.fixture(scope="module")
def hinted(vllm_venv, tiny_model, tmp_path_factory):
    """``vllm serve --kv-policy lru`` with hints (:func:`_served`): twelve prompts of three full blocks each
    sent twice (twice the usable cache in all, so the second round's hits depend on what was kept), every
    fourth retained, the next released, and two sessions sharing a document (:func:`_sends`)."""
    return _served(vllm_venv, tiny_model, tmp_path_factory.mktemp("hints-live"), "--kv-policy", "lru")


@pytest.fixture(scope="module")
def hinted_wa(vllm_venv, tiny_model, tmp_path_factory):
    """The same traffic served by ``wa`` (the tests' hp file) with ``--kv-hint-counterfactual``."""
    import json

    from vllm_support import HP_TEST

    tmp = tmp_path_factory.mktemp("hints-live-wa")
    hp = tmp / "hp.json"
    hp.write_text(json.dumps(HP_TEST))
    return {**_served(vllm_venv, tiny_model, tmp, "--kv-policy-config", str(hp), "--kv-hint-counterfactual"), "hp": hp}


def test_a_malformed_hint_gets_a_400_naming_the_field_and_changes_nothing(hinted):
    (first, first_body), (second, second_body) = hinted["refused"]
    assert first == second == 400
    assert "retain_priority" in first_body["error"]["message"], first_body
    assert "retain_s" in second_body["error"]["message"], second_body
    # the server served every request after them, and none of them reached the engine (not recorded)
    from kvprof.profiler.reader import read_trace

    trace, _ = read_trace(hinted["rec"])
    assert trace.n_requests == len(hinted["cached"]) == len(_sends())


def test_the_recording_keeps_each_requests_hint(hinted):
    from kvprof.models.hints import Hint, hint_of_args
    from kvprof.profiler.reader import read_trace

    trace, _ = read_trace(hinted["rec"])
    order = trace.timestamp.argsort(kind="stable")
    expected = [hint_of_args(xargs) for _, _, xargs in _sends()]
    assert expected[3] == Hint(release=True, session="A") and expected[4] == Hint(retain_s=1000.0, tag=1)
    assert [trace.hints.hints()[i] for i in order] == expected


def _replayed(hinted, policy: str = "lru") -> dict[str, int]:
    """Cached prompt tokens of ``kvprof compare --hints trace`` of the recording, by policy row."""
    import json
    import subprocess

    out = hinted["tmp"] / "compare"
    config = ["--config", str(hinted["hp"])] if "hp" in hinted else []
    proc = subprocess.run([str(hinted["venv"] / "bin" / "kvprof"), "compare", str(hinted["rec"]), "--policies", policy,
                           *config, "--hints", "trace", "--hint-max-fraction", BUDGET, "--eval-window", "0:", "-o",
                           str(out), "-j", "1"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {run["policy"]: run["cached_tokens"] for run in json.loads((out / "results.json").read_text())["runs"]}


def test_the_server_cached_what_the_simulator_predicts_with_its_hints(hinted):
    """The live hits are ``kvprof compare --hints trace``'s lru+hints row of the server's own recording (with
    the server's budget), and not its lru row (the same traffic without the hints): the hints changed what
    was cached. Tag 1's 1,000 s retentions are honoured until the cache first evicts, and beyond its horizon
    (seconds here) after that, where the ones held then lapse too, as in the simulator (the budget's lapses:
    the in-process test above)."""
    live = sum(tokens for _, tokens in hinted["cached"])
    replayed = _replayed(hinted)
    assert live == replayed["lru+hints"], replayed
    assert live != replayed["lru"], replayed
    assert 'kvprof_hint_blocks_total{' in hinted["metrics"] and 'outcome="retained_hits"' in hinted["metrics"]
    beyond = [line for line in hinted["metrics"].splitlines()
              if line.startswith("kvprof_hint_blocks_total{") and 'outcome="beyond_horizon"' in line]
    assert beyond and float(beyond[0].rsplit(" ", 1)[1]) > 0, beyond
    horizon = [line for line in hinted["metrics"].splitlines() if line.startswith("kvprof_hint_horizon_seconds{")]
    assert horizon and 0 < float(horizon[0].rsplit(" ", 1)[1]) < 1000, horizon  # why tag 1's 1,000 s went beyond


def test_a_release_naming_a_session_demotes_only_that_sessions_own_blocks(hinted, monkeypatch):
    """A's release demoted its own block and not the document B reads too: B found the document cached
    again after the prompts that evicted the released blocks. The simulator's replay of the recording
    with the sessions dropped (a release demoting all of A's blocks) caches other tokens than the server did."""
    import json

    from kvprof.models.hints import SESSION_FIELD, HintColumns
    from tests.helpers import invoke

    b_again = [tokens for label, tokens in hinted["cached"] if label == "B again"]
    assert b_again[0] >= len(DOCUMENT), hinted["cached"]
    of_extra = HintColumns.of_extra.__func__
    monkeypatch.setattr(HintColumns, "of_extra", classmethod(
        lambda cls, extra, n: of_extra(cls, {k: v for k, v in extra.items() if k != SESSION_FIELD}, n)))
    out = hinted["tmp"] / "compare-without-sessions"
    result = invoke("compare", hinted["rec"], "--policies", "lru", "--hints", "trace", "--hint-max-fraction", BUDGET,
                    "--eval-window", "0:", "-o", out, "-j", "1")
    assert result.exit_code == 0, result.output[-3000:]
    without = {run["policy"]: run["cached_tokens"] for run in json.loads((out / "results.json").read_text())["runs"]}
    assert without["lru+hints"] != sum(tokens for _, tokens in hinted["cached"]), without


def test_vllms_request_checks_refuse_a_malformed_hint_under_either_model_runner(in_vllm):
    """The check the plugin adds is run by vLLM's own per-request validators (V1 and V2 model runner), which
    raise vLLM's validation error (a 400) naming the field, and pass a good hint or none."""
    if not in_vllm:
        return
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    from kvprof.vllm.hints import HINT_CHECK, HINT_CHECK_V2

    validators = [lambda params: validate_logits_processors_parameters((HINT_CHECK,), params)]
    if HINT_CHECK_V2 is not None:
        from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

        validators.append(build_custom_logits_processors_params_validator((HINT_CHECK_V2,)))
    for validate in validators:
        validate(SamplingParams(extra_args={"retain_s": 30, "hint_tag": 2}))
        validate(SamplingParams())
        with pytest.raises(VLLMValidationError, match="'retain_priority'"):
            validate(SamplingParams(extra_args={"retain_s": 30, "retain_priority": -1}))


def test_the_plugin_adds_the_check_for_the_model_runner_in_use(in_vllm):
    if not in_vllm:
        return
    from types import SimpleNamespace

    from kvprof.vllm.hints import HINT_CHECK, HINT_CHECK_V2
    from kvprof.vllm.plugin import add_hint_check

    def config(**kwargs):
        model = SimpleNamespace(logits_processors=["my.module:Mine"], runner_type="generate")
        return SimpleNamespace(model_config=model, speculative_config=None, use_v2_model_runner=False, **kwargs)

    v1 = config()
    assert add_hint_check(v1) and add_hint_check(v1)  # once only
    assert v1.model_config.logits_processors == ["my.module:Mine", HINT_CHECK]
    v2 = config()
    v2.use_v2_model_runner = True
    assert add_hint_check(v2) == (HINT_CHECK_V2 is not None)
    assert v2.model_config.logits_processors[-1] == (HINT_CHECK_V2 or "my.module:Mine")
    speculative = config()
    speculative.speculative_config = object()
    assert not add_hint_check(speculative) and speculative.model_config.logits_processors == ["my.module:Mine"]


def test_the_hint_counterfactual_is_the_served_policy_without_the_hints(hinted_wa):
    """``--kv-hint-counterfactual``: what the live counterfactual of ``wa`` found is ``kvprof compare``'s ``wa``
    row of the server's own recording (the same traffic, no hints), the server's own hits its ``wa+hints`` row,
    and the two differ: /metrics says what the clients' hints were worth to the policy in force."""
    replayed = _replayed(hinted_wa, "wa")
    lines = [line for line in hinted_wa["metrics"].splitlines()
             if line.startswith("kvprof_counterfactual_cached_blocks_total{") and 'policy="wa"' in line]
    assert len(lines) == 1, lines
    assert float(lines[0].rsplit(" ", 1)[1]) * 32 == replayed["wa"], (lines, replayed)
    assert sum(tokens for _, tokens in hinted_wa["cached"]) == replayed["wa+hints"], (hinted_wa["cached"], replayed)
    assert replayed["wa"] != replayed["wa+hints"], replayed

"""How long after SIGINT/SIGTERM a compiled recorded-timing replay raises, and what.

    cd CHECKOUT && POLICY=lru PYTHONPATH=CHECKOUT python research/interrupt_latency.py N_REQUESTS SIGNAL_AFTER_S

Replays N synthetic requests on recorded timing (compiled engine) in a child, signals it
SIGNAL_AFTER_S seconds into the replay, and prints what reached Python and how many seconds after
the signal (the child's and this process's monotonic clocks are the same clock), for SIGINT and
SIGTERM. Run it from the checkout measured (``python -c`` puts the working directory first on the
path). The child holds no Python objects per request, so its exit is not a garbage collection.
"""
import os, signal, subprocess, sys, time

CHILD = r'''
import sys, time, numpy as np
from tests.test_timed import recorded
from kvprof.policy import make_policy
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload
from kvprof.cli.app import _terminate
import signal
signal.signal(signal.SIGTERM, _terminate)
n = int(sys.argv[1])
rng = np.random.default_rng(0)
rows = [(0.01 * i, "api", 1, [int(h) for h in rng.integers(0, 50_000, 6)]) for i in range(n)]
sched = [0.01 * i + 0.001 for i in range(n)]
fin = [0.01 * i + 5.0 for i in range(n)]
trace = recorded(rows, sched, fin, block_size=16)
config = SimConfig(engine_block_size=16, timing="recorded")
workload = prepare_workload(trace, engine_block_size=16)
def run(k):
    small = prepare_workload(recorded(rows[:k], sched[:k], fin[:k], block_size=16), engine_block_size=16)
    return simulate(small, make_policy(__import__("os").environ.get("POLICY", "belady")), 2000, config, engine="compiled")
run(100)  # compile first
print("replaying", flush=True)
del rows, sched, fin, trace
started = time.perf_counter()
try:
    simulate(workload, make_policy(__import__("os").environ.get("POLICY", "belady")), 2000, config, engine="compiled")
except BaseException as exc:  # what reached Python, and when (the same monotonic clock as the parent's)
    print(f"{type(exc).__name__} at {time.monotonic():.3f}", flush=True)
    raise
print(f"finished in {time.perf_counter() - started:.1f} s", flush=True)
'''


def main():
    n, after = int(sys.argv[1]), float(sys.argv[2])
    for signum in (signal.SIGINT, signal.SIGTERM):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert child.stdout.readline().strip() == "replaying"
        time.sleep(after)
        sent = time.monotonic()
        child.send_signal(signum)
        out = child.stdout.readline().strip()
        code = child.wait()
        name, _, at = out.rpartition(" at ")
        late = f"{float(at) - sent:.3f} s" if at else "never"
        err = child.stderr.read().strip().splitlines()
        where = [line.strip() for line in err if line.strip().startswith("File")][-1:] 
        print(f"{signal.Signals(signum).name}: raised {name or out!r} {late} after the signal, exit {code}, in {where}; "
              f"last stderr line: {err[-1] if err else ''}")


main()

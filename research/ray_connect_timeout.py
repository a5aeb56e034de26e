"""Seconds until `kvprof compare --ray auto` gives up, per RAY_ADDRESS."""
import os, socket, subprocess, sys, time

listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
for address in ("bogus:1", "127.0.0.1:1", f"127.0.0.1:{listener.getsockname()[1]}"):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", "from kvprof.cli.app import main; main()", "compare", "/nonexistent.jsonl",
                           "--ray", "auto", "-o", "/tmp/never-written"], env={**os.environ, "RAY_ADDRESS": address},
                          capture_output=True, text=True, timeout=300)
    message = " ".join(done.stderr.replace("│", " ").split())
    print(f"{address}: exit {done.returncode} after {time.monotonic() - started:.1f} s: ...{message[-150:]}")

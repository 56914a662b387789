"""How long each way out of an epoch takes, the plain DataLoader beside
fastpin.Loader, in the situations of the never-hang guarantee
(docs/design.md): a slow source and a worker that hangs forever. Each case runs in a fresh interpreter; a case still
running after --cap seconds is killed and shown as "> cap".

    python benchmarks/shutdown_times.py [--slow 3] [--cap 40] [--case break_hang ...]

Times are seconds: for break, from the `break` to the line after the loop;
for Ctrl-C and interpreter exit, from the signal (or the script's last line)
to the end of the process (caught: to the
line after `del it`); for the watchdog, from the SIGALRM handler's raise
to the `except`; for a new iter(), the iter() call.
"""
from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import os, signal, sys, threading, time
import torch
from torch.utils.data import DataLoader, Dataset
import fastpin
MODE, SLOW = sys.argv[1], float(sys.argv[2])
# Started from a background job, SIGINT comes ignored: Ctrl-C as at a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)
SETTLE = 0.5  # after the first batch: every worker busy (or hung) by now, for both loaders
class Slow(Dataset):
    def __len__(self): return 1000
    def __getitem__(self, i):
        time.sleep(SLOW)
        return torch.full((16,), i)
class Hang(Dataset):
    # Sample 0 arrives; every later one hangs forever in its worker.
    def __len__(self): return 1000
    def __getitem__(self, i):
        if i > 0:
            time.sleep(10 ** 6)
        return torch.full((16,), i)
def wrap(dl):
    return dl if MODE == "plain" else fastpin.Loader(dl, device="cpu")
def report(seconds):
    print("RESULT", seconds, flush=True)
"""

CASES = {
    "break_slow0": ("`break`, slow source, 0 workers", """
        for b in wrap(DataLoader(Slow(), batch_size=1)):
            time.sleep(SETTLE)
            t0 = time.monotonic()
            break
        report(time.monotonic() - t0)
    """),
    "break_slow2": ("`break`, slow source, 2 workers", """
        for b in wrap(DataLoader(Slow(), batch_size=1, num_workers=2)):
            time.sleep(SETTLE)
            t0 = time.monotonic()
            break
        report(time.monotonic() - t0)
    """),
    "break_hang": ("a worker that hangs: `break`", """
        for b in wrap(DataLoader(Hang(), batch_size=1, num_workers=2)):
            time.sleep(SETTLE)
            t0 = time.monotonic()
            break
        report(time.monotonic() - t0)
    """),
    "sigint_hang": ("a worker that hangs: Ctrl-C (uncaught)", """
        it = iter(wrap(DataLoader(Hang(), batch_size=1, num_workers=2)))
        next(it)
        time.sleep(SETTLE)
        def interrupt():
            print("T0", time.time(), flush=True)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        threading.Timer(0.5, interrupt).start()
        next(it)
    """),
    "sigint_caught_hang": ("a worker that hangs: Ctrl-C in next(), caught, the iterator dropped", """
        it = iter(wrap(DataLoader(Hang(), batch_size=1, num_workers=2)))
        next(it)
        time.sleep(SETTLE)
        sent = []
        def interrupt():
            sent.append(time.monotonic())
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        threading.Timer(0.5, interrupt).start()
        try:
            next(it)
        except KeyboardInterrupt:
            raised = time.monotonic()
        del it
        report(time.monotonic() - sent[0])
        print("interrupt", raised - sent[0], file=sys.stderr)
        os._exit(0)
    """),
    "exit_hang": ("a worker that hangs: interpreter exit", """
        it = iter(wrap(DataLoader(Hang(), batch_size=1, num_workers=2)))
        next(it)
        time.sleep(SETTLE)
        print("T0", time.time(), flush=True)
    """),
    "alarm_slow0": ("SIGALRM watchdog raising in the loop, slow source, 0 workers", """
        raised = []
        def watchdog(signum, frame):
            raised.append(time.monotonic())
            raise TimeoutError("step took too long")
        signal.signal(signal.SIGALRM, watchdog)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            for b in wrap(DataLoader(Slow(), batch_size=1)):
                time.sleep(10)
        except TimeoutError:
            report(time.monotonic() - raised[0])
    """),
    "newiter_hang": ("a worker that hangs: a new iter()", """
        loader = wrap(DataLoader(Hang(), batch_size=1, num_workers=2))
        first = iter(loader)
        next(first)
        time.sleep(SETTLE)
        t0 = time.monotonic()
        second = iter(loader)
        report(time.monotonic() - t0)
        os._exit(0)  # the hung workers: not part of this case
    """),
}


def run(case: str, mode: str, slow: float, cap: float) -> str:
    code = PRELUDE + textwrap.dedent(CASES[case][1])
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    errors = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-c", code, mode, str(slow)], cwd=HERE, env=env,
                            stdout=subprocess.PIPE, stderr=errors, text=True,
                            start_new_session=True)
    t0 = result = None
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put("")  # the end of its output: it exited (or closed stdout)

    threading.Thread(target=read, daemon=True).start()
    try:
        # Line by line, and the end of the process by wait(): orphaned workers
        # may hold the pipe open after it.
        deadline = time.time() + cap + 30  # start-up and the first batch come first
        while t0 is None and result is None:
            try:
                line = lines.get(timeout=max(deadline - time.time(), 0.01))
            except queue.Empty:
                return f"> {cap:.0f}"
            if not line:
                proc.wait()
                errors.seek(0)
                last = (errors.read().strip().splitlines() or ["no output"])[-1]
                return f"failed (rc {proc.returncode}: {last[:80]})"
            if line.startswith("T0 "):
                t0 = float(line.split()[1])
            elif line.startswith("RESULT "):
                result = float(line.split()[1])
        proc.wait(timeout=cap)
        end = time.time()
    except subprocess.TimeoutExpired:
        return f"> {cap:.0f}"
    finally:
        try:
            os.killpg(proc.pid, 9)  # the process and any worker it left behind
        except ProcessLookupError:
            pass
        proc.wait()
    if result is None and t0 is not None:
        result = end - t0
    if result is None:
        return f"failed (rc {proc.returncode})"
    return f"> {cap:.0f}" if result > cap else f"{result:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slow", type=float, default=3.0, help="seconds per sample of the slow source")
    p.add_argument("--cap", type=float, default=40.0, help="seconds before a case counts as hung")
    p.add_argument("--case", action="append", choices=sorted(CASES))
    args = p.parse_args()
    print(f"slow source: {args.slow} s a sample; cap {args.cap} s\n")
    print("| case | plain DataLoader | fastpin.Loader |")
    print("|---|---:|---:|")
    for case in args.case or list(CASES):
        plain = run(case, "plain", args.slow, args.cap)
        ours = run(case, "fastpin", args.slow, args.cap)
        print(f"| {CASES[case][0]} | {plain} | {ours} |", flush=True)


if __name__ == "__main__":
    main()

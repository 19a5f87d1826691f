#!/usr/bin/env python3
"""Runs a `cargo test` command and stops it when a test hangs, naming the test.

libtest has no per-test time limit on stable Rust, only its note "test X has been
running for over 60 seconds". This wrapper copies the output through, notes when each
test started (60 s before that note), and when one test has run longer than
MAILROOM_TEST_LIMIT_SECS (default 900) or the whole run longer than
MAILROOM_SUITE_LIMIT_SECS (default 3600), it names every test still running, kills the
command's process group and exits 124.

Usage: test-watchdog.py COMMAND [ARGS...]
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

RUNNING = re.compile(r"^test (\S+) has been running for over (\d+) seconds")
ENDED = re.compile(r"^test (\S+) \.\.\. ")


def main() -> int:
    per_test = float(os.environ.get("MAILROOM_TEST_LIMIT_SECS", "900"))
    whole = float(os.environ.get("MAILROOM_SUITE_LIMIT_SECS", "3600"))
    started = time.monotonic()
    proc = subprocess.Popen(
        sys.argv[1:],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    running: dict[str, float] = {}
    lock = threading.Lock()
    hung: list[str] = []
    stopped = threading.Event()

    def watch() -> None:
        while proc.poll() is None:
            now = time.monotonic()
            with lock:
                late = [n for n, t in running.items() if now - t > per_test]
                over = now - started > whole
                if late or over:
                    why = (
                        f"over the per-test limit of {per_test:.0f} s (MAILROOM_TEST_LIMIT_SECS)"
                        if late
                        else f"the suite passed its limit of {whole:.0f} s (MAILROOM_SUITE_LIMIT_SECS)"
                    )
                    names = late or sorted(running)
                    hung.extend(names)
                    for n in names:
                        print(f"watchdog: test {n} hung: {why}", flush=True)
                    if not names:
                        print(f"watchdog: {why}; no test was noted as running", flush=True)
                    stopped.set()
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    return
            time.sleep(1)

    threading.Thread(target=watch, daemon=True).start()
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode("utf-8", "replace")
        sys.stdout.write(line)
        sys.stdout.flush()
        m = RUNNING.match(line)
        if m:
            with lock:
                running.setdefault(m.group(1), time.monotonic() - float(m.group(2)))
            continue
        m = ENDED.match(line)
        if m:
            with lock:
                running.pop(m.group(1), None)
    status = proc.wait()
    if stopped.is_set():
        print(f"watchdog: stopped; hung: {', '.join(hung) or 'none noted'}", flush=True)
        return 124
    return status


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Scores a Python completion by the share of its tests that pass (a `type = "command"` reward).

    run_python_tests.py TESTS < completion

TESTS holds assert statements, one per line (a dataset's `tests` column; a list column arrives
joined with newlines). The completion comes on stdin; its code is the last ```python (or
unlabelled) fenced block, else the last fenced block of any language, else the whole text.
The code runs once, then every test on its own (at most --per-test seconds each); what the code
prints is discarded. The last line printed is the fraction of tests that passed: 0 when the code
does not even run. See configs/code_reward.toml.
"""

import argparse
import contextlib
import io
import re
import signal
import sys

FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.S)


def extract_code(text):
    """The code of a completion: its last python block, else last block, else the text."""
    blocks = FENCE.findall(text)
    python = [body for lang, body in blocks if lang.lower() in ("", "python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return text


class TestTimeout(Exception):
    pass


def _alarm(_signum, _frame):
    raise TestTimeout()


def run(code, tests, per_test):
    """The number of `tests` that pass after running `code` (0 when the code fails)."""
    namespace = {"__name__": "__solution__"}
    has_alarm = hasattr(signal, "SIGALRM")
    if has_alarm:
        signal.signal(signal.SIGALRM, _alarm)
    sink = io.StringIO()

    def attempt(source):
        if has_alarm:
            signal.setitimer(signal.ITIMER_REAL, per_test)
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                exec(compile(source, "<completion>", "exec"), namespace)
            return True
        except BaseException:  # noqa: BLE001 - a failing test, whatever it raises or exits with
            return False
        finally:
            if has_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
            sink.seek(0)
            sink.truncate()

    if not attempt(code):
        return 0
    return sum(attempt(t) for t in tests)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", help="assert statements, one per line")
    parser.add_argument("--per-test", type=float, default=2.0, help="seconds per test")
    args = parser.parse_args()
    tests = [line.strip() for line in args.tests.splitlines() if line.strip()]
    completion = sys.stdin.read()
    passed = run(extract_code(completion), tests, args.per_test) if tests else 0
    print(passed / len(tests) if tests else 0.0, file=sys.__stdout__)


if __name__ == "__main__":
    main()

"""Scores and containment of the sandboxed APPS code reward.

Hostile programs run under both isolations: "namespaces" (skipped where the kernel refuses
unshare) and the "audit_hook" fallback, forced by patching the cached probe.
"""

from __future__ import annotations

import os
import select
import socket
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from marlhf.rewards import SandboxLimits, code_reward, code_rewards
from marlhf.rewards import code as code_module

ADD_TESTS = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
ONE_TEST = {"inputs": [""], "outputs": ["done\n"]}
SHORT_TIMEOUT_S = 1.0  # for programs meant to time out
LONG_TIMEOUT_S = 5.0  # for programs meant to end by themselves; ending before it shows they did
SLACK_S = 5.0  # bound on the time after a timeout, generous for a loaded 2-core machine
REPO_ROOT = Path(__file__).resolve().parents[2]
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="uid drop and uid-wide cleanup need root")


def program(source: str) -> str:
    return textwrap.dedent(source).lstrip("\n")


@pytest.fixture(params=["namespaces", "audit_hook"])
def isolation(request, monkeypatch):
    """Forces the isolation; after the test, asserts that no process of a sandbox uid it used is
    left (only those: other test runs on this machine use other uids at the same time)."""
    if request.param == "namespaces" and code_module._isolation() != "namespaces":
        pytest.skip("the kernel refuses network/mount namespaces here")
    monkeypatch.setattr(code_module, "_isolation", lambda: request.param)
    used_uids = set()
    enter = code_module._sandbox_uid.__enter__

    def recording_enter(self):
        uid = enter(self)
        used_uids.add(uid)
        return uid

    monkeypatch.setattr(code_module._sandbox_uid, "__enter__", recording_enter)
    yield request.param
    if os.geteuid() == 0:
        assert used_uids and code_module._live_pids(uids=used_uids) == []


def timed_reward(source: str, timeout_s: float, tests: dict = ONE_TEST, **kwargs) -> tuple[float, float]:
    start = time.monotonic()
    score = code_reward(program(source), tests, timeout_s=timeout_s, **kwargs)
    return score, time.monotonic() - start


# ----------------------------------------------------------------------------- scores


def test_all_tests_pass_scores_one():
    assert code_reward("a, b = map(int, input().split())\nprint(a + b)", ADD_TESTS) == 1.0


def test_partial_scores_in_proportion_to_passed_tests():
    tests = {"inputs": ["1\n", "2\n", "3\n", "4\n"], "outputs": ["1\n", "4\n", "9\n", "0\n"]}
    assert code_reward("n = int(input())\nprint(n * n)", tests) == pytest.approx(-0.3 + 1.3 * 3 / 4)
    assert code_reward("print(-1)", tests) == pytest.approx(-0.3)


def test_runtime_error_scores_minus_point_six_even_after_passing_tests():
    source = "n = int(input())\nif n == 3:\n    raise ValueError(n)\nprint(n + n)"
    tests = {"inputs": ["1\n", "3\n"], "outputs": ["2\n", "6\n"]}
    assert code_reward(source, tests) == -0.6
    assert code_reward("import sys\nsys.exit(3)", ONE_TEST) == -0.6
    assert code_reward("print('done')\nexit()", ONE_TEST) == 1.0  # exit status 0 is no error
    # exiting like a failed sandbox set-up is a runtime error of the program, it does not raise
    assert code_reward("import os, sys\nprint('setup failed', file=sys.stderr)\nos._exit(1)", ONE_TEST) == -0.6


def test_standard_library_is_importable():
    # also after the uid drop, wherever the interpreter is installed (here: under /root)
    source = (
        "import bisect, collections, decimal, fractions, heapq, itertools, json, math, random, re, socket\n"
        "import statistics, string, sys, threading\n"
        "print(fractions.Fraction(1, 2) + decimal.Decimal(0) if False else 'done')"
    )
    assert code_reward(source, ONE_TEST) == 1.0


def test_syntax_error_scores_minus_one():
    assert code_reward("def f(:\n    return 1", ADD_TESTS) == -1.0
    assert code_reward("print('done')\x00", ONE_TEST) == -1.0  # null byte: compile() raises ValueError


def test_stdout_comparison_tolerates_trailing_whitespace_and_lines_of_inputs():
    assert code_reward("print('done   ')\nprint()\nprint('  ')", ONE_TEST) == 1.0
    assert code_reward("print(' done')", ONE_TEST) == 1.0  # token by token, as APPS
    assert code_reward("print('do ne')", ONE_TEST) == -0.3
    tests = {"inputs": [["2", "3"]], "outputs": [["5", "6"]]}  # lists of lines, as in some APPS rows
    assert code_reward("a, b = int(input()), int(input())\nprint(a + b)\nprint(a * b)", tests) == 1.0


def test_output_matching_rules():
    matches = code_module._output_matches
    assert matches(b"1 2\r\n3\n\n", "1 2\n3", call_based=False)
    assert matches(b"0.3333333\n", "0.33333333333\n", call_based=False)
    assert not matches(b"0.34\n", "0.33\n", call_based=False)
    assert not matches(b"1 2 3\n", "1 2\n", call_based=False)
    assert not matches(b"", "1\n", call_based=False)
    assert matches(b"[1, 2]\n", [[1, 2]], call_based=True)  # APPS wraps call outputs in a list
    assert matches(b"[1, 2]\n", [1, 2], call_based=True)
    assert not matches(b"[2, 1]\n", [[1, 2]], call_based=True)
    assert not matches(b"not json\n", ["not json"], call_based=True)


def test_fn_name_calls_function_or_solution_method():
    tests = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]}
    assert code_reward("def add(a, b):\n    print('noise')\n    return a + b", tests) == 1.0
    solution = "class Solution:\n    def add(self, a, b):\n        return a + b if a < 3 else 0"
    assert code_reward(solution, tests) == pytest.approx(-0.3 + 1.3 / 2)
    pair = {"fn_name": "pair", "inputs": [[1]], "outputs": [[[1, 2]]]}
    assert code_reward("def pair(a):\n    return (a, a + 1)", pair) == 1.0  # tuple result as a JSON list
    assert code_reward("def pair(a):\n    return {a}", pair) == -0.3  # not JSON: wrong answer
    assert code_reward("def other(a):\n    return a", pair) == -0.6  # missing function
    assert code_reward("def pair(a):\n    return 1 / 0", pair) == -0.6
    assert code_reward("def pair(a)\n    return a", pair) == -1.0


def test_code_rewards_keeps_order_with_parallel_workers():
    programs = ["print(int(input()) + 1)", "print(0)", "raise SystemExit(2)", "def f(:"]
    tests = [{"inputs": ["1\n"], "outputs": ["2\n"]}] * 4
    assert code_rewards(programs, tests, max_workers=2) == [1.0, -0.3, -0.6, -1.0]
    with pytest.raises(ValueError, match="same length"):
        code_rewards(programs, tests[:3])


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="input_output"):
        code_reward("print(1)", {"inputs": ["1"]})
    with pytest.raises(ValueError, match="input_output"):
        code_reward("print(1)", {"inputs": [], "outputs": []})
    with pytest.raises(ValueError, match="input_output"):
        code_reward("print(1)", {"fn_name": "f", "inputs": ["1"], "outputs": ["1"]})
    with pytest.raises(ValueError, match="timeout_s"):
        code_reward("print(1)", ADD_TESTS, timeout_s=0)
    with pytest.raises(ValueError, match="max_workers"):
        code_rewards(["print(1)"], [ADD_TESTS], max_workers=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxLimits(memory_bytes=0)


def test_sandbox_set_up_failure_raises(monkeypatch):
    monkeypatch.setattr(code_module, "_CHILD_SCRIPT", "/nonexistent/_sandbox_child.py")
    with pytest.raises(RuntimeError, match="setup failed"):
        code_reward("print('done')", ONE_TEST)


# ----------------------------------------------------------------------------- containment


def test_infinite_loop_times_out_as_failed_test(isolation):
    tests = {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]}
    source = "n = int(input())\nwhile n == 2:\n    pass\nprint(n)"
    score, elapsed = timed_reward(source, SHORT_TIMEOUT_S, tests)
    assert score == pytest.approx(-0.3 + 1.3 / 3)  # test 1 passed, 2 timed out, 3 not run
    assert elapsed < SHORT_TIMEOUT_S + SLACK_S


def test_sleep_times_out(isolation):
    score, elapsed = timed_reward("import time\ntime.sleep(60)\nprint('done')", SHORT_TIMEOUT_S)
    assert score == -0.3
    assert SHORT_TIMEOUT_S <= elapsed < SHORT_TIMEOUT_S + SLACK_S


def test_memory_is_bounded(isolation):
    limits = SandboxLimits(memory_bytes=128 << 20)
    assert timed_reward("x = bytearray(10**11)", LONG_TIMEOUT_S, limits=limits)[0] == -0.6
    # MemoryError well before the timeout (which would score -0.3)
    source = "x = []\nwhile True:\n    x.append(bytearray(1 << 20))"
    assert timed_reward(source, LONG_TIMEOUT_S, limits=limits)[0] == -0.6


def test_fork_bomb_is_contained_and_killed(isolation):
    source = """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    score, elapsed = timed_reward(source, SHORT_TIMEOUT_S)
    assert score == -0.3
    assert elapsed < SHORT_TIMEOUT_S + SLACK_S


def test_process_count_is_limited(isolation):
    # Root ignores RLIMIT_NPROC: this passes only because the child runs under a sandbox uid.
    source = f"""
        import os, time
        children = 0
        for _ in range(200):
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
            except OSError:
                break
            children += 1
        print('done' if children < {SandboxLimits().max_processes} else children)
    """
    score, elapsed = timed_reward(source, LONG_TIMEOUT_S)
    assert score == 1.0
    assert elapsed < LONG_TIMEOUT_S


@requires_root
def test_children_that_leave_the_process_group_are_killed(isolation):
    # The stray child holds stdout open and sleeps in its own session; the answer is already out.
    source = """
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
        print('done')
    """
    score, elapsed = timed_reward(source, LONG_TIMEOUT_S)
    assert score == 1.0
    assert elapsed < LONG_TIMEOUT_S  # the exit of the program ends the test, not the stray's pipe


def test_stdout_flood_is_cut(isolation):
    limits = SandboxLimits(max_output_bytes=1 << 16)
    score, elapsed = timed_reward("while True:\n    print('x' * 1000)", LONG_TIMEOUT_S, limits=limits)
    assert score == -0.3
    assert elapsed < LONG_TIMEOUT_S  # cut by the output bound, not the timeout


@requires_root
def test_program_runs_unprivileged_in_an_empty_writable_directory(isolation):
    source = """
        import os
        assert os.getuid() != 0 and os.getgid() != 0 and os.getgroups() == []
        assert os.listdir('.') == []
        with open('scratch.txt', 'w') as f:
            f.write('done')
        print(open('scratch.txt').read())
    """
    assert timed_reward(source, LONG_TIMEOUT_S)[0] == 1.0


def test_writes_outside_the_working_directory_do_not_happen(isolation):
    name = f"marlhf-escape-{uuid.uuid4().hex}"
    targets = [Path("/tmp") / name, Path("/var/tmp") / name, Path("/dev/shm") / name, REPO_ROOT / name]
    source = f"""
        import os, subprocess
        for path in {[str(t) for t in targets]!r}:
            for attempt in (
                lambda: open(path, 'w').write('escaped'),
                lambda: os.close(os.open(path, os.O_WRONLY | os.O_CREAT)),
                lambda: os.system('echo escaped > ' + path),
                lambda: subprocess.run(['sh', '-c', 'echo escaped > ' + path]),
            ):
                try:
                    attempt()
                except Exception:
                    pass
        print('done')
    """
    try:
        timed_reward(source, LONG_TIMEOUT_S)  # score irrelevant: under namespaces /tmp writes land on a private tmpfs
        assert [t for t in targets if t.exists()] == []
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


def test_network_is_unreachable(isolation):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        source = f"""
            import socket
            with socket.create_connection(('127.0.0.1', {port}), timeout=2) as connection:
                connection.sendall(b'escaped')
            print('done')
        """
        score, _ = timed_reward(source, LONG_TIMEOUT_S)
        assert score == -0.6
        readable, _, _ = select.select([listener], [], [], 0.2)
        assert readable == []  # no connection arrived


def test_audit_hook_blocks_ctypes_and_spawning(monkeypatch):
    monkeypatch.setattr(code_module, "_isolation", lambda: "audit_hook")
    assert code_reward("import ctypes\nctypes.CDLL(None).getpid()\nprint('done')", ONE_TEST) == -0.6
    assert code_reward("import subprocess\nsubprocess.run(['true'])\nprint('done')", ONE_TEST) == -0.6
    assert code_reward("import _posixsubprocess\nprint('done')", ONE_TEST) == -0.6
    assert code_reward("import sqlite3\nprint('done')", ONE_TEST) == -0.6
    assert code_reward("import os\nos.execv('/bin/true', ['true'])", ONE_TEST) == -0.6


@requires_root
def test_refused_namespaces_fall_back_to_the_audit_hook_with_a_warning(monkeypatch, caplog):
    real_probe = code_module._probe

    def probe(isolation):
        if isolation == "namespaces":
            raise RuntimeError("unshare refused")
        real_probe(isolation)

    monkeypatch.setattr(code_module, "_probe", probe)
    assert code_module._isolation.__wrapped__() == "audit_hook"
    assert "falling back to an audit hook" in caplog.text


@requires_root
def test_parallel_sandboxes_do_not_share_the_process_limit(isolation):
    # Each program runs under its own uid: the first filling its RLIMIT_NPROC (with sleeping
    # children, so that the CPU stays free) leaves the other program free to fork.
    fork_bomb = program("""
        import os, time
        while True:
            try:
                if os.fork() == 0:
                    time.sleep(60)
            except OSError:
                time.sleep(60)
    """)
    forking_solution = program("""
        import os, time
        time.sleep(0.3)  # let the bomb fill its process limit first
        for _ in range(8):
            if os.fork() == 0:
                os._exit(0)
            os.wait()
        print('done')
    """)
    scores = code_rewards([fork_bomb, forking_solution], [ONE_TEST] * 2, timeout_s=2.0, max_workers=2)
    assert scores == [-0.3, 1.0]

"""Sandboxed unit-test reward for generated Python programs (the paper's APPS reward).

Every test case runs the program in a fresh child process (``python -I -S _sandbox_child.py``,
so no site-packages, environment variables or user site; the standard library stays importable
after the uid drop, see ``_sandbox_child``):

- own session and process group, killed as a whole (SIGKILL) on timeout or when it ends;
- rlimits: CPU time, address space, file size, process count, no core files;
- when the parent is root: the child drops to a per-run unprivileged uid/gid (taken from
  ``SANDBOX_UIDS`` under an flock, so concurrent evaluations never share one), which makes
  RLIMIT_NPROC effective (root ignores it) and lets the parent kill every process of that uid
  afterwards, including children that left the process group with setsid();
- isolation ``"namespaces"`` (needs root and a kernel that allows unshare): a new network
  namespace (no interface is up, so nothing, 127.0.0.1 included, can be reached) and a new
  mount namespace with fresh tmpfs mounts over the world-writable directories (/tmp, /var/tmp,
  /dev/shm, /run/lock), discarded when the child exits; the working directory is an empty
  directory on that tmpfs;
- isolation ``"audit_hook"`` (the fallback when unshare is refused, logged as a warning): an
  audit hook installed before the program runs refuses sockets, process spawning (exec,
  subprocess, posix_spawn, os.system), ctypes, links, and any write/create/rename/delete
  outside the empty working directory the parent made; fork stays allowed (children inherit
  the hook) and is bounded by RLIMIT_NPROC;
- stdout is read up to ``SandboxLimits.max_output_bytes``; more fails the test.

Without root neither the uid drop nor the namespaces are available: the audit hook and rlimits
still apply, but RLIMIT_NPROC counts all processes of the user and a child that calls setsid()
can outlive the kill of its process group. A warning says so.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import itertools
import json
import logging
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Container, Sequence

from marlhf.rewards._sandbox_child import EXIT_COMPILE_ERROR, READY

logger = logging.getLogger(__name__)

REWARD_ALL_PASSED = 1.0
REWARD_NONE_PASSED = -0.3
REWARD_RUNTIME_ERROR = -0.6
REWARD_COMPILE_ERROR = -1.0

# uids with no account on usual systems (Debian reserves 60000-64999 for on-demand global
# accounts); one per concurrently running program, across processes.
SANDBOX_UIDS = range(64000, 64512)
_UID_CURSOR = itertools.count(os.getpid())  # processes start at different uids
_CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one test run of a generated program."""

    memory_bytes: int = 1 << 30  # RLIMIT_AS
    max_processes: int = 32  # RLIMIT_NPROC (threads count too), per sandbox uid
    max_file_bytes: int = 1 << 24  # RLIMIT_FSIZE
    max_output_bytes: int = 1 << 22  # stdout read before the test is failed and the child killed

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(f"SandboxLimits.{field.name} must be positive, got {getattr(self, field.name)}")


@dataclasses.dataclass(frozen=True)
class _RunResult:
    status: str  # "ok" | "timeout" | "output_limit" | "runtime_error" | "compile_error"
    stdout: bytes


def code_reward(
    program: str,
    input_output: dict,
    timeout_s: float = 4.0,
    limits: SandboxLimits = SandboxLimits(),
) -> float:
    """Score ``program`` on APPS-style tests ``{"inputs": [...], "outputs": [...], "fn_name"?: str}``.

    Without ``fn_name`` each input (a string, or a list of lines joined by newlines) is the
    program's stdin and its stdout must equal the output up to trailing whitespace on each line
    and trailing blank lines, or token by token with numbers equal within 1e-5 relative / 1e-8
    absolute (APPS's checker accepts both). With ``fn_name`` the program is executed as a
    module, then ``fn_name`` (a top-level function, or a method of ``class Solution`` as in
    APPS's LeetCode problems) is called with the input list unpacked as positional arguments;
    the JSON form of the result (tuples as lists) must equal the output, or its first element
    when the output is a non-empty list (APPS stores most call outputs wrapped in a list).

    Tests run in order, each in a fresh sandboxed process (see the module docstring):

    - the program does not compile (SyntaxError, also raised for null bytes or nesting too
      deep to compile): ``-1.0``, no test is run;
    - a test ends with an uncaught exception (MemoryError at the memory limit included),
      a non-zero exit status or a fatal signal: ``-0.6``, the remaining tests are not run;
    - otherwise ``-0.3 + 1.3 * passed / total``: ``+1.0`` when all pass, ``-0.3`` when none
      does. A test fails on wrong output, on more stdout than ``limits.max_output_bytes``, or
      on timeout (``timeout_s`` of wall time from process start, or the CPU-time limit of
      ``ceil(timeout_s) + 1`` s). After a timeout the remaining tests are not run and count as
      failed, so a program that never terminates costs one timeout, not one per test.
    """
    inputs, outputs, fn_name = parse_tests(input_output)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    isolation = _isolation()
    with _sandbox_uid() as uid, tempfile.TemporaryDirectory(prefix="marlhf-code-") as run_dir:
        program_path = os.path.join(run_dir, "program.py")
        with open(program_path, "w", encoding="utf-8") as f:
            f.write(program)
        os.chmod(run_dir, 0o711)  # the sandbox uid may enter its working directory, not list
        passed = 0
        for test_input, expected in zip(inputs, outputs):
            if fn_name is None:
                stdin = test_input if isinstance(test_input, str) else "\n".join(test_input)
            else:
                stdin = json.dumps(test_input)
            result = _run_in_sandbox(program_path, stdin, fn_name, run_dir, uid, isolation, timeout_s, limits)
            if result.status == "compile_error":
                return REWARD_COMPILE_ERROR
            if result.status == "runtime_error":
                return REWARD_RUNTIME_ERROR
            if result.status == "timeout":
                break
            if result.status == "ok" and _output_matches(result.stdout, expected, fn_name is not None):
                passed += 1
    return REWARD_NONE_PASSED + (REWARD_ALL_PASSED - REWARD_NONE_PASSED) * passed / len(inputs)


def code_rewards(
    programs: Sequence[str],
    input_outputs: Sequence[dict],
    timeout_s: float = 4.0,
    max_workers: int | None = None,
    limits: SandboxLimits = SandboxLimits(),
) -> list[float]:
    """``code_reward`` of each (program, tests) pair, at most ``max_workers`` (default: CPU count)
    programs at a time; results are in the order of ``programs``."""
    if len(programs) != len(input_outputs):
        raise ValueError(
            f"programs and input_outputs must have the same length, got {len(programs)} and {len(input_outputs)}"
        )
    if max_workers is None:
        max_workers = os.cpu_count() or 1
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    _isolation()  # probe once before the workers start
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(lambda args: code_reward(*args, timeout_s, limits), zip(programs, input_outputs)))


def parse_tests(input_output: dict) -> tuple[list, list, str | None]:
    """(inputs, outputs, fn_name) of an APPS ``input_output`` dict; a ValueError when code_reward cannot run it
    (the loader skips such rows, so a run never stops on one)."""
    if not isinstance(input_output, dict) or "inputs" not in input_output or "outputs" not in input_output:
        raise ValueError("input_output must be a dict with 'inputs' and 'outputs' lists")
    inputs, outputs = input_output["inputs"], input_output["outputs"]
    if len(inputs) != len(outputs) or not inputs:
        raise ValueError(
            f"input_output needs as many outputs as inputs and at least one test, got {len(inputs)} and {len(outputs)}"
        )
    fn_name = input_output.get("fn_name") or None
    if fn_name is not None and not all(isinstance(args, list) for args in inputs):
        raise ValueError("input_output['inputs'] must be lists of arguments when fn_name is given")
    return inputs, outputs, fn_name


def _output_matches(stdout: bytes, expected: Any, call_based: bool) -> bool:
    if call_based:
        try:
            result = json.loads(stdout)
        except ValueError:  # no result line: the program exited before the call
            return False
        return result == expected or (isinstance(expected, list) and len(expected) > 0 and result == expected[0])
    actual = stdout.decode("utf-8", errors="replace")
    expected = expected if isinstance(expected, str) else "\n".join(expected)
    if _strip_trailing_whitespace(actual) == _strip_trailing_whitespace(expected):
        return True
    actual_tokens, expected_tokens = actual.split(), expected.split()
    return len(actual_tokens) == len(expected_tokens) and all(
        _tokens_match(a, e) for a, e in zip(actual_tokens, expected_tokens)
    )


def _strip_trailing_whitespace(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _tokens_match(actual: str, expected: str) -> bool:
    if actual == expected:
        return True
    try:
        return math.isclose(float(actual), float(expected), rel_tol=1e-5, abs_tol=1e-8)
    except ValueError:
        return False


# ----------------------------------------------------------------------------- parent side


class _sandbox_uid:
    """Context manager holding a uid of ``SANDBOX_UIDS`` exclusively (an flock on a file in a
    root-only directory); ``None`` when not root (no uid to switch to)."""

    def __enter__(self) -> int | None:
        self._lock_fd = None
        if os.geteuid() != 0:
            return None
        lock_dir = os.path.join(tempfile.gettempdir(), "marlhf-sandbox-uids")
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        info = os.lstat(lock_dir)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077:
            raise RuntimeError(f"{lock_dir} must be a directory owned by root with mode 0700")
        # Round robin: a uid just used may still have killed processes waiting to be reaped,
        # which count against its RLIMIT_NPROC.
        start = next(_UID_CURSOR) % len(SANDBOX_UIDS)
        for uid in itertools.chain(SANDBOX_UIDS[start:], SANDBOX_UIDS[:start]):
            fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._lock_fd = fd
            _kill_uid(uid)  # a previous holder that died without cleaning up
            return uid
        raise RuntimeError(f"all {len(SANDBOX_UIDS)} sandbox uids are in use")

    def __exit__(self, *exc_info: object) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)


def _run_in_sandbox(
    program_path: str,
    stdin: str,
    fn_name: str | None,
    run_dir: str,
    uid: int | None,
    isolation: str,
    timeout_s: float,
    limits: SandboxLimits,
) -> _RunResult:
    workdir = None
    if isolation == "audit_hook":
        workdir = tempfile.mkdtemp(dir=run_dir)
        if uid is not None:
            os.chown(workdir, uid, uid)
    ready_read, ready_write = os.pipe()
    config = {
        "ready_fd": ready_write,
        "program_path": program_path,
        "fn_name": fn_name,
        "uid": uid,
        "namespaces": isolation == "namespaces",
        "workdir": workdir,
        "cpu_s": math.ceil(timeout_s) + 1,
        "limits": dataclasses.asdict(limits),
    }
    with tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode("utf-8"))
        stdin_file.seek(0)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _CHILD_SCRIPT, json.dumps(config)],
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd="/",
            env={"PATH": os.defpath, "LC_ALL": "C.UTF-8"},
            start_new_session=True,
            pass_fds=(ready_write,),
        )
    os.close(ready_write)
    try:
        stdout, stderr, stopped = _collect(proc, uid, time.monotonic() + timeout_s, limits.max_output_bytes)
        # all sandbox processes are dead: the read cannot block
        ready = os.read(ready_read, len(READY)) == READY
    finally:
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        os.close(ready_read)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    if not ready and stopped != "timeout":
        raise RuntimeError(f"code sandbox setup failed: {stderr.decode(errors='replace').strip()}")
    if stopped is not None:
        return _RunResult(stopped, stdout)
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # CPU-time limit (soft, hard)
        return _RunResult("timeout", stdout)
    if proc.returncode == EXIT_COMPILE_ERROR:
        return _RunResult("compile_error", stdout)
    if proc.returncode != 0:
        return _RunResult("runtime_error", stdout)
    return _RunResult("ok", stdout)


def _collect(
    proc: subprocess.Popen, uid: int | None, deadline: float, max_output_bytes: int
) -> tuple[bytes, bytes, str | None]:
    """Read stdout (bounded) and the head of stderr until both pipes close; returns
    (stdout, stderr head, "timeout" | "output_limit" | None). Every process of the sandbox is
    killed before it returns; as soon as the child has exited, since what it left behind may
    hold the pipes open."""
    stdout, stderr = bytearray(), bytearray()
    killed = False
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            selector.register(proc.stderr, selectors.EVENT_READ)
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return bytes(stdout), bytes(stderr), "timeout"
                for key, _ in selector.select(timeout=min(remaining, 0.05)):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fileobj)
                    elif key.fileobj is proc.stdout:
                        stdout += chunk
                        if len(stdout) > max_output_bytes:
                            return bytes(stdout[:max_output_bytes]), bytes(stderr), "output_limit"
                    elif len(stderr) < 4096:  # beyond this stderr is drained and dropped
                        stderr += chunk[: 4096 - len(stderr)]
                if not killed and _has_exited(proc):
                    _kill_sandbox(proc, uid)
                    killed = True
        while not _has_exited(proc):  # pipes closed early, e.g. os.close(1)
            if time.monotonic() >= deadline:
                return bytes(stdout), bytes(stderr), "timeout"
            time.sleep(0.01)
        return bytes(stdout), bytes(stderr), None
    finally:
        if not killed:
            _kill_sandbox(proc, uid)


def _has_exited(proc: subprocess.Popen) -> bool:
    """Whether the child has exited, without reaping it: while it is a zombie its pid, and so
    its process group id, cannot be reused, which keeps killpg safe."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_sandbox(proc: subprocess.Popen, uid: int | None) -> None:
    """Kill the child's process group, then every process of the sandbox uid (children that
    called setsid()). The child is not reaped here."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if uid is not None:
        _kill_uid(uid)


def _kill_uid(uid: int) -> None:
    for _ in range(1000):
        pids = _live_pids(uids={uid})
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    raise RuntimeError(f"could not kill the processes of sandbox uid {uid}")


def _live_pids(uids: Container[int]) -> list[int]:
    """Pids whose real uid is in ``uids``, zombies excluded (they hold no resources)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(status["Uid"].split()[0]) in uids and not status["State"].strip().startswith(("Z", "X")):
            pids.append(int(entry.name))
    return pids


@functools.cache
def _isolation() -> str:
    """``"namespaces"`` when a probe child can set them up, else ``"audit_hook"`` (with a warning);
    raises when even the audit-hook sandbox (and its uid drop, as root) does not start."""
    if os.geteuid() != 0:
        logger.warning(
            "code sandbox: not running as root, so no uid drop and no namespaces; sockets and writes "
            "outside the working directory are blocked by an audit hook only, RLIMIT_NPROC counts all "
            "processes of this user, and children that call setsid() may outlive a timeout"
        )
    else:
        try:
            _probe("namespaces")
            return "namespaces"
        except RuntimeError as error:
            logger.warning(
                "code sandbox: network/mount namespaces unavailable (%s); falling back to an audit hook "
                "that blocks sockets, process spawning, ctypes and writes outside the working directory",
                error,
            )
    _probe("audit_hook")
    return "audit_hook"


def _probe(isolation: str) -> None:
    with _sandbox_uid() as uid, tempfile.TemporaryDirectory(prefix="marlhf-code-") as run_dir:
        program_path = os.path.join(run_dir, "program.py")
        with open(program_path, "w") as f:
            f.write("print('ok')\n")
        os.chmod(run_dir, 0o711)
        result = _run_in_sandbox(program_path, "", None, run_dir, uid, isolation, 10.0, SandboxLimits())
    if result != _RunResult("ok", b"ok\n"):
        raise RuntimeError(f"code sandbox probe with isolation {isolation!r} failed: {result}")


def code_reward_fn(records: list[dict[str, Any]]) -> Callable[[list[str], list[str]], list[float]]:
    """Reward function scoring each response as a program on the unit tests of its prompt's record."""
    tests_by_prompt: dict[str, str] = {}
    for index, record in enumerate(records):
        tests = record.get("input_output")
        if not isinstance(tests, str) or not tests.strip():
            raise ValueError(f"reward='code' needs an input_output field (JSON unit tests) in record {index}")
        if tests_by_prompt.setdefault(record["prompt"], tests) != tests:
            raise ValueError(f"record {index} repeats a prompt with different unit tests")

    def score(prompts: list[str], responses: list[str]) -> list[float]:
        return code_rewards(responses, [json.loads(tests_by_prompt[p]) for p in prompts])

    return score

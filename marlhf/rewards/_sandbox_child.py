"""Child side of the code sandbox of ``marlhf.rewards.code``: run as ``python -I -S <this file> CONFIG``.

Kept apart from ``code.py`` so that the child imports nothing beyond what it needs (in particular
not ``subprocess``/``_posixsubprocess``, whose ``fork_exec`` raises no audit event) before the
untrusted program runs. When the set-up is done the child writes ``READY`` to the descriptor
``config["ready_fd"]`` and closes it, before any program code runs (so the program cannot
fake a set-up failure); a set-up failure prints its message on stderr and exits 1.
"""

import builtins
import ctypes
import errno
import json
import os
import resource
import signal
import site
import sys

EXIT_COMPILE_ERROR = 97
READY = b"ready"
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # world-writable on usual systems
WORKDIR_IN_NAMESPACE = "/tmp/sandbox"  # on the private tmpfs mounted over /tmp

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38


def main(config: dict) -> None:
    try:
        with open(config["program_path"], "rb") as f:
            source = f.read()
        libc = ctypes.CDLL(None, use_errno=True)
        workdir = _enter_namespaces(libc, config["uid"]) if config["namespaces"] else config["workdir"]
        os.chdir(workdir)
        limits = config["limits"]
        resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_s"], config["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if config["uid"] is not None:
            _keep_import_path_reachable()
            os.setgroups([])
            os.setgid(config["uid"])
            os.setuid(config["uid"])
        # after the uid change, which clears the parent-death signal
        for option, value in ((_PR_SET_NO_NEW_PRIVS, 1), (_PR_SET_PDEATHSIG, signal.SIGKILL)):
            if libc.prctl(option, value, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), f"prctl({option}, {value})")
        call_args = json.load(sys.stdin) if config["fn_name"] is not None else None
        if not config["namespaces"]:
            sys.addaudithook(_make_audit_hook(os.path.realpath(workdir)))
    except Exception as error:  # reported to the parent, which raises
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        os._exit(1)
    os.write(config["ready_fd"], READY)
    os.close(config["ready_fd"])

    try:
        code = compile(source, "<program>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        os._exit(EXIT_COMPILE_ERROR)

    site.setquit()  # exit() and quit(), which -S leaves out and many APPS programs call
    sys.argv = ["<program>"]
    fn_name = config["fn_name"]
    if fn_name is None:
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
        return
    # The program's own prints go to /dev/null; the call's result is the only stdout line.
    result_file = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    namespace = {"__name__": "__sandbox__", "__builtins__": builtins}
    exec(code, namespace)
    if fn_name in namespace:
        function = namespace[fn_name]
    else:
        function = getattr(namespace["Solution"](), fn_name)  # KeyError/AttributeError: runtime error
    result = function(*call_args)
    try:
        line = json.dumps(_jsonable(result))
    except (TypeError, ValueError):  # not comparable to a JSON output: the test fails
        line = "not json"
    result_file.write(line + "\n")
    result_file.flush()
    os._exit(0)


def _jsonable(value):
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _keep_import_path_reachable():
    """The interpreter may live under a directory the sandbox uid cannot search (e.g. a pyenv in
    /root): open the import directories while still root and import through /proc/self/fd/N,
    which needs no permission on their ancestors (a process may always use its own fds). The
    search paths of packages already imported (collections, json, ...) are rewritten too."""
    reachable = {}
    for i, path in enumerate(sys.path):
        if os.path.isdir(path):
            reachable[path] = f"/proc/self/fd/{os.open(path, os.O_RDONLY | os.O_DIRECTORY)}"
            sys.path[i] = reachable[path]

    def rewrite(path):
        for original, replacement in reachable.items():
            if path == original or path.startswith(original + os.sep):
                return replacement + path[len(original):]
        return path

    for module in list(sys.modules.values()):
        if isinstance(getattr(module, "__path__", None), list):
            module.__path__[:] = [rewrite(path) for path in module.__path__]
    sys.path_importer_cache.clear()


def _enter_namespaces(libc, uid):
    """New network namespace (no interface up) and mount namespace with fresh tmpfs over the
    world-writable directories; returns the empty working directory made on it."""
    if libc.unshare(_CLONE_NEWNET | _CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET | CLONE_NEWNS)")
    # keep the tmpfs mounts below inside this namespace
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    for path in PRIVATE_DIRS:
        if os.path.isdir(path) and libc.mount(
            b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=64m,nr_inodes=4096,mode=1777"
        ) != 0:
            raise OSError(ctypes.get_errno(), f"mount tmpfs on {path}")
    os.mkdir(WORKDIR_IN_NAMESPACE, 0o700)
    if uid is not None:
        os.chown(WORKDIR_IN_NAMESPACE, uid, uid)
    return WORKDIR_IN_NAMESPACE


def _make_audit_hook(workdir):
    """Hook refusing sockets, process spawning, ctypes, gc walks and changes outside ``workdir``
    (fork stays allowed: children inherit the hook)."""
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked_prefixes = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "gc.get_")
    blocked_events = {"os.system", "os.symlink", "os.link", "os.mknod", "os.mkfifo", "os.forkpty", "pty.spawn"}
    # fork_exec, and file writes from C, that raise no (checkable) audit event
    blocked_imports = {"_posixsubprocess", "_sqlite3", "_dbm", "_gdbm", "readline"}
    path_events = {  # event -> positions of the path arguments it changes
        "os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1),
        "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
        "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (1,),
    }

    def inside_workdir(path):
        if isinstance(path, int):  # an already open descriptor
            return True
        real = os.path.realpath(os.fsdecode(path))
        return real == workdir or real.startswith(workdir + os.sep)

    def hook(event, args):
        if event.startswith(blocked_prefixes) or event in blocked_events:
            raise PermissionError(errno.EPERM, f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in blocked_imports:
            raise PermissionError(errno.EPERM, f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & write_flags)
            if writes and path is not None and not inside_workdir(path):
                raise PermissionError(errno.EACCES, f"sandbox: writing {path!r} is not allowed")
            # a directory descriptor would let *at() calls (dir_fd=...) write outside
            if mode is None and path is not None and not inside_workdir(path) and os.path.isdir(path):
                raise PermissionError(errno.EACCES, f"sandbox: opening directory {path!r} is not allowed")
        elif event in path_events and not all(inside_workdir(args[i]) for i in path_events[event]):
            raise PermissionError(errno.EACCES, f"sandbox: {event} outside the working directory is not allowed")

    return hook


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

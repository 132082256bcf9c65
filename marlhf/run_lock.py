"""One run per output directory: an exclusive lock held for the run's lifetime.

    lock = OutputDirLock(output_dir)   # flock on OUTPUT_DIR/.marlhf.lock, which names the holder (pid, host)
    lock.release()                     # also released when the process ends, however it ends

A second run into the same directory stops at once with an error naming the holder, instead of deleting the
first run's temporary checkpoints and mixing their files. The lock is advisory (flock): it holds between
marlhf runs on one machine and, where the file system supports flock, across machines.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

LOCK_FILE = ".marlhf.lock"
_HELD: dict[str, OutputDirLock] = {}  # this process's locks, by lock file path


class OutputDirLock:
    def __init__(self, output_dir: str | Path) -> None:
        directory = Path(output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / LOCK_FILE
        self._key = str(self.path.resolve())
        earlier = _HELD.pop(self._key, None)
        if earlier is not None:  # a run of this process that stopped with an exception and never released it
            earlier.release()
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(self._fd)
            self._fd = None
            raise ValueError(f"output_dir {directory} is in use by {holder} (lock file {self.path}): wait for that "
                             "run to end or choose another output_dir") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        _HELD[self._key] = self

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        _HELD.pop(self._key, None)

"""WorkerLock: one live writer per (output directory, worker index). An flock dies with its process,
so a crashed run never blocks the next one.

Invariants: a holder's lock file is the one at `.lock-wNNNNN` (a lock taken on a file that was removed
meanwhile is dropped and taken again on the new file); the file holds the holder's pid; `is_held` probes
without blocking and holds a shared lock for microseconds only, which an acquiring run waits out."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from batchgen.errors import JobError

PROBE_GRACE_S = 0.5  # how long an acquiring run retries before calling the lock another run's


def lock_path(out_dir: Path, tag: str) -> Path:
    return out_dir / f".lock-{tag}"


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def is_held(path: Path) -> bool:
    """Whether a live process holds the lock at `path` (False when there is no such file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's shared lock at once
    return False


class WorkerLock:
    def __init__(self, out_dir: Path, tag: str) -> None:
        self.path = lock_path(out_dir, tag)
        deadline = time.monotonic() + PROBE_GRACE_S
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() < deadline:  # perhaps `batchgen status` probing it: try again shortly
                    os.close(fd)
                    time.sleep(0.02)
                    continue
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise JobError(f"another batchgen run (pid {holder}) is writing {tag} of {out_dir}; wait for it to "
                               f"finish or stop it, or give this run another output directory or worker "
                               f"index") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the file was removed (a failed start cleaning up) after we opened it: open it anew
        self._fd = fd
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1

    def remove(self) -> None:
        """Delete the lock file, then release: a run that opened the old file meanwhile sees it is gone."""
        if self._fd >= 0:
            self.path.unlink(missing_ok=True)
        self.release()

"""WorkerLock: one live writer per (output directory, worker index). An flock dies with its process,
so a crashed run never blocks the next one."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from batchgen.errors import JobError


class WorkerLock:
    def __init__(self, out_dir: Path, tag: str) -> None:
        self.path = out_dir / f".lock-{tag}"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise JobError(f"another batchgen run (pid {holder}) is writing {tag} of {out_dir}; wait for it to "
                           f"finish or stop it, or give this run another output directory or worker index") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1

"""WorkerLock: one live writer per (output directory, worker index); DirectoryLock: one start at a time per
output directory. An flock dies with its process, so a crashed run never blocks the next one.

Invariants: a holder's lock file is the one at `.lock-wNNNNN` (a lock taken on a file that was removed
meanwhile is dropped and taken again on the new file); the file holds the holder's record, one JSON line:
pid, worker index, worker count and unit_rows (the partition it deals, job/workers.py; null until sized), so
that running workers of different partitions are refused (`check_partition`); a file of an earlier batchgen
holds the pid alone. `is_held` probes without blocking and holds a shared lock for microseconds only, which an
acquiring run waits out. Starts (taking a worker lock and checking the partition, or a --fresh) hold the
DirectoryLock, an flock on the output folder itself, so two starts never check each other half-recorded."""

from __future__ import annotations

import fcntl
import json
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


def holder(path: Path) -> dict:
    """The record in a lock file: {"pid", "worker", "count", "unit_rows"} (None where not recorded)."""
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        text = ""
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict):  # an earlier batchgen's lock file: the pid alone
        record = {"pid": text or "unknown"}
    return {"pid": record.get("pid", "unknown"), "worker": record.get("worker"), "count": record.get("count"),
            "unit_rows": record.get("unit_rows"), "dealer": record.get("dealer")}


def describe(record: dict) -> str:
    """"worker 1 of 2 (pid 123)" from a lock record."""
    who = f"worker {record['worker']}" if record["worker"] is not None else "a worker"
    of = f" of {record['count']}" if record["count"] is not None else ""
    by = f", dealt rows by {record['dealer']}" if record.get("dealer") else ""
    return f"{who}{of} (pid {record['pid']}{by})"


class _HeldLock:
    """An flock held on `path` through `_fd` (-1 once released)."""

    path: Path
    _fd: int = -1

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1

    def remove(self) -> None:
        """Delete the file while holding it, then release: a run that opened the old file meanwhile (or waits on
        it) finds it gone and opens a new one."""
        if self._fd >= 0:
            self.path.unlink(missing_ok=True)
        self.release()


class WorkerLock(_HeldLock):
    def __init__(self, out_dir: Path, tag: str, *, count: int | None = None, unit_rows: int | None = None,
                 dealer: str | None = None) -> None:
        """`dealer`: who deals this worker its rows while the job runs (a Ray driver: "ray <host>:<pid>"), None
        for a fixed partition (count and unit_rows)."""
        self.path = lock_path(out_dir, tag)
        self.record = {"pid": os.getpid(), "worker": int(tag[1:]) if tag[1:].isdigit() else None, "count": count,
                       "unit_rows": unit_rows, "dealer": dealer}
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
                os.close(fd)
                raise JobError(f"another batchgen run (pid {holder(self.path)['pid']}) is writing {tag} of {out_dir}; "
                               f"wait for it to finish or stop it, or give this run another output directory or "
                               f"worker index") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the file was removed (a failed start cleaning up) after we opened it: open it anew
        self._fd = fd
        self._write()

    def _write(self) -> None:
        data = (json.dumps(self.record) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def record_partition(self, count: int, unit_rows: int) -> None:
        """Record the partition this worker deals (once sized from the source); check it with check_partition."""
        self.record.update(count=count, unit_rows=unit_rows)
        self._write()


DIRECTORY_LOCK_FILE = ".lock-dir"


class DirectoryLock(_HeldLock):
    """An exclusive flock on OUT/.lock-dir, waited for: held while a run starts (worker lock, partition check,
    an interrupted --fresh finished) and through a --fresh's renames; never while rows are generated. A file,
    not the folder itself: NFS emulates flock with POSIX locks, which a read-only directory fd cannot take."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / DIRECTORY_LOCK_FILE
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, self.path):
                break
            os.close(fd)  # removed by a failed first start while we waited: take the new file
        self._fd = fd

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()  # no .lock-dir left between starts (a waiter finds it gone and opens a new one)


def running_workers(out_dir: Path, except_path: Path | None = None) -> list[dict]:
    """The records of the lock files a live process holds (other than `except_path`), by worker tag."""
    return [holder(p) for p in sorted(out_dir.glob(".lock-w*")) if p != except_path and is_held(p)]


def check_partition(out_dir: Path, mine: WorkerLock) -> None:
    """JobError when a running worker deals the rows otherwise than `mine` (another worker count, or another
    unit once both are sized): run at once, the two would generate some rows twice. Call holding the
    DirectoryLock, after `mine` recorded what it knows."""
    me = mine.record
    for other in running_workers(out_dir, mine.path):
        if other.get("dealer") is not None or me.get("dealer") is not None:
            if other.get("dealer") == me.get("dealer"):
                continue  # one dealer's workers: it hands each row to one of them
            theirs = other.get("dealer") or "a fixed partition"
            raise JobError(f"worker {me['worker']} cannot start in {out_dir}: {describe(other)} is running there, "
                           f"its rows dealt by {theirs}, not by {me.get('dealer') or 'a fixed partition'}; two "
                           f"dealers at once would generate some rows twice. Wait until it finishes or stop it "
                           f"(resuming afterwards, either way, is fine)")
        if other["count"] is not None and me["count"] is not None and other["count"] != me["count"]:
            differs = f"{other['count']} workers, not {me['count']}"
        elif None not in (other["unit_rows"], me["unit_rows"], other["count"]) and \
                other["unit_rows"] != me["unit_rows"]:
            differs = (f"rows dealt in units of {other['unit_rows']}, not {me['unit_rows']} (the job's "
                       f"source.worker_unit_rows, or the source's row count it is sized from, differ)")
        else:
            continue
        raise JobError(f"worker {me['worker']} of {me['count']} cannot start in {out_dir}: {describe(other)} is "
                       f"running there with another partition ({differs}); workers running at once must deal "
                       f"the rows alike or some rows are generated twice. Start this worker with "
                       f"--num-workers {other['count']} and the same job, or wait until no worker is running "
                       f"(resuming with another worker count is fine then)")


class AllWorkersLock:
    """Every existing worker lock of an output folder but one's own, taken without waiting (for --fresh):
    JobError naming a worker that is running. Writes nothing into the lock files."""

    def __init__(self, out_dir: Path, except_path: Path | None = None) -> None:
        self._fds: list[int] = []
        try:
            for path in sorted(out_dir.glob(".lock-w*")):
                if path == except_path:
                    continue
                try:
                    fd = os.open(path, os.O_RDWR)
                except FileNotFoundError:  # a failed start removed its own lock file meanwhile
                    continue
                self._fds.append(fd)
                deadline = time.monotonic() + PROBE_GRACE_S
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() < deadline:  # a status probe: wait it out
                            time.sleep(0.02)
                            continue
                        raise JobError(f"--fresh refused: {describe(holder(path))} is running in {out_dir}; "
                                       f"starting over would delete what it is writing. Stop it (or wait for it "
                                       f"to finish), then run again; nothing was deleted") from None
        except BaseException:
            self.release()
            raise

    def __enter__(self) -> AllWorkersLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing drops the flock
        self._fds = []

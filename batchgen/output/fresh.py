"""`--fresh`: take batchgen's files out of an output directory, crash-safe, and nothing else.

Protocol (the caller holds the directory lock and every worker's lock, output/lock.py):
  1. refuse if the folder holds anything batchgen did not write (layout.foreign_entries), naming it;
  2. mkdir OUT/.batchgen-fresh (a fresh is pending from here on);
  3. rename manifest/ into it: from this instant no row is done (the manifest is the ledger);
  4. rename every other batchgen entry into it (data/, rejects/, logs/, reports/, fingerprint, job, card);
  5. rename .batchgen-fresh to .batchgen-deleted-<pid>-<ns>: the old output is gone from the folder;
  6. delete that folder.
Every step is one rename or mkdir, so a crash (kill -9) between any two leaves one of: nothing moved; the
manifest moved and some data still in place (shards no manifest names: orphans, never done); everything moved;
a half-deleted `.batchgen-deleted-*`. The next run of any kind finishes a pending fresh before it reads
anything (`finish_interrupted`): a pending folder means the user asked to start over. Lock files and the
marker stay: they are not results.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from batchgen.errors import JobError
from batchgen.output import layout

MAX_NAMED = 8  # foreign entries named in a refusal (then a count)

# manifest first: once it is out of place no row counts as done, whatever of the data is still there
# (the marker stays: the folder is still batchgen's output)
ORDER = ("manifest", *layout.SHARD_DIRS, "logs", "reports",
         *(f for f in layout.TOP_FILES if f != layout.MARKER_FILE), layout.CARD_FILE, layout.LEGACY_JOB_FILE)


def _step(op, *args) -> None:
    """Every filesystem change of a fresh start goes through here (crash tests count and interrupt them)."""
    op(*args)


def refusal(out_dir: Path, reasons: list[str] = ()) -> str | None:
    """Why `out_dir` may not be started over (None: everything in it is batchgen's). `reasons`: what the caller
    knows more (the job file or the source lies in it), said first."""
    foreign = layout.foreign_entries(out_dir)
    if not foreign and not reasons:
        return None
    named = ", ".join(foreign[:MAX_NAMED]) + (f" and {len(foreign) - MAX_NAMED} more" if len(foreign) > MAX_NAMED
                                               else "")
    why = "; ".join(reasons)
    held = f"it holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} batchgen did not write: {named}"
    return (f"--fresh refused: output.dir {out_dir} is not batchgen's alone ({why + '; ' if why else ''}"
            f"{held if foreign else 'nothing was deleted'}). --fresh deletes only what batchgen wrote and will "
            f"not start over in a folder shared with other files: give the job an output folder of its own "
            f"(output.dir or --output, e.g. out/NAME), or move those entries out and run again")


def _move_in(out_dir: Path, pending: Path) -> None:
    for name in ORDER:
        path = out_dir / name
        if (path.exists() or path.is_symlink()) and layout.is_batchgen_entry(out_dir, name):
            _step(os.rename, path, pending / name)


def _delete(folder: Path) -> None:
    """Delete a moved-out old output, file by file (each unlink a step), tolerating another process doing
    the same."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            try:
                _step(os.unlink, os.path.join(root, name))
            except FileNotFoundError:
                pass
        for name in dirs:
            try:
                _step(os.rmdir, os.path.join(root, name))
            except (FileNotFoundError, OSError):
                pass
    try:
        _step(os.rmdir, folder)
    except FileNotFoundError:
        pass


def _finish(out_dir: Path, pending: Path) -> None:
    _move_in(out_dir, pending)
    gone = out_dir / f"{layout.FRESH_DELETING_PREFIX}{os.getpid()}-{time.time_ns()}"
    _step(os.rename, pending, gone)
    _delete(gone)


def start_over(out_dir: Path, reasons: list[str] = ()) -> None:
    """Delete batchgen's files in `out_dir` (JobError naming what is not batchgen's, deleting nothing)."""
    finish_interrupted(out_dir)
    why = refusal(out_dir, reasons)
    if why is not None:
        raise JobError(why)
    pending = out_dir / layout.FRESH_PENDING_DIR
    _step(os.mkdir, pending)
    _finish(out_dir, pending)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def finish_interrupted(out_dir: Path) -> None:
    """Complete a fresh start a crash interrupted (step 2 onwards), and delete old outputs whose deleting
    process is gone. The caller holds the directory lock."""
    pending = out_dir / layout.FRESH_PENDING_DIR
    if pending.is_dir():
        print(f"batchgen: {out_dir}: an earlier `--fresh` was interrupted; finishing it (its results were "
              f"already being deleted)", file=sys.stderr)
        _finish(out_dir, pending)
    for path in out_dir.glob(f"{layout.FRESH_DELETING_PREFIX}*"):
        pid = path.name.removeprefix(layout.FRESH_DELETING_PREFIX).split("-")[0]
        if path.is_dir() and not (pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid))):
            _delete(path)

"""The output directory's layout: what batchgen writes there, how each of its files is recognised, and where
its resolved job lives. Only what `is_batchgen_entry` recognises is ever deleted by batchgen (`--fresh`).

Recognition is by name: a fixed set of top-level names, and inside batchgen's folders the exact names of the
worker-tagged files it writes there (`data/part-w00000-000003.parquet`, `manifest/w00000.jsonl`,
`logs/throughput-w00000.jsonl`, `reports/w00000.json`) or one of the report's fixed names, each also as its hidden
temporary (`.NAME...tmp...`). A folder inside batchgen's folders is never
batchgen's. Three files need their content: the dataset card (card.MARKER), `job.resolved.yaml` (its first line,
RESOLVED_JOB_HEADER) and the `job.yaml` of an output begun before `job.resolved.yaml` existed
(`is_legacy_job_file`).

The marker file `.batchgen` says the folder is used as an output by a batchgen that writes the resolved job to
`job.resolved.yaml`: in a marked folder `job.yaml` is a user's file, never read as the output's job, unless the
marker recorded it (its SHA-256) as the earlier batchgen's when it marked that output, and it is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import yaml

from batchgen.output.ledger import MANIFEST_NAME, TMP_NAME
from batchgen.output.manifest_line import SHARD_NAME
from batchgen.output.temp_file import removed_on_failure

MARKER_FILE = ".batchgen"
FORMAT_VERSION = 1
RESOLVED_JOB_FILE = "job.resolved.yaml"
LEGACY_JOB_FILE = "job.yaml"  # where batchgen before FORMAT_VERSION 1 wrote the resolved job
LEGACY_JOB_DIGEST = "legacy_job_sha256"  # the marker's record of that file when it marked such an output
RESOLVED_JOB_HEADER = "# batchgen: the resolved job this output was generated with; editing it changes nothing\n"
FRESH_PENDING_DIR = ".batchgen-fresh"  # a --fresh in progress (output/fresh.py)
FRESH_DELETING_PREFIX = ".batchgen-deleted-"  # a finished --fresh's old output, being deleted

# batchgen's folders and what may lie in them; top-level files it writes (card and legacy job.yaml: by content)
SHARD_DIRS = ("data", "rejects")
# `batchgen repair`'s damaged files moved aside (output/repair.py): batchgen's, but --fresh leaves it in place
# (it may hold the only copy of rows someone wants to salvage)
QUARANTINE_DIR = "quarantine"
OWNED_DIRS = (*SHARD_DIRS, "manifest", "logs", "reports")
UPSTREAM_ORDER_FILE = "upstream_order.json"  # a position-keyed chained job's record (output/upstream_order.py)
TOP_FILES = (MARKER_FILE, RESOLVED_JOB_FILE, "fingerprint.json", "numerics.json", UPSTREAM_ORDER_FILE)
LOCK_FILES = (".lock-dir",)  # lock.DIRECTORY_LOCK_FILE; worker locks: _LOCK
REPORT_FILES = ("throughput.png", "lengths.png", "index.html")
CARD_FILE = "README.md"
# the worker-tagged files batchgen writes in its folders beside the shards and manifests (whose names the ledger
# knows), each with its temporary name; exactly these: a user's `w00000-notes.txt` beside them is not batchgen's
_TAGGED = {
    "manifest": re.compile(r"\.w\d{5}\.jsonl\.repair\.tmp"),  # output/repair.py rewrites a manifest
    "logs": re.compile(r"throughput-w\d{5}\.jsonl"),
    "reports": re.compile(r"w\d{5}\.json|\.w\d{5}\.json\.tmp\d*"),
}
_LOCK = re.compile(r"^\.lock-w\d{5}$")
_SECTIONS = ("model", "source", "prompt", "sampling", "engine", "output")


def _is_temp_of(name: str, known: tuple[str, ...]) -> bool:
    """`.NAME.<anything>tmp<anything>` (or `.STEM.<pid>.tmp.SUFFIX`) for a NAME in `known`."""
    if not name.startswith(".") or "tmp" not in name:
        return False
    return any(name.startswith(f".{k}.") or name.startswith(f".{Path(k).stem}.") for k in known)


def is_legacy_job_file(path: Path, out_dir: Path) -> bool:
    """Whether `path` (OUT/job.yaml) is the resolved job an earlier batchgen wrote: a plain YAML dump (no
    comment) of every section, whose output.dir is this folder's absolute path. A user's job file says
    `dir: .` (or another relative path) or carries comments, so it is never taken for one."""
    try:
        text = path.read_text()
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    if not isinstance(data, dict) or any(line.lstrip().startswith("#") for line in text.splitlines()):
        return False
    output = data.get("output")
    return all(isinstance(data.get(s), dict) for s in _SECTIONS) and isinstance(output, dict) and \
        str(output.get("dir")) == str(out_dir.resolve())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_batchgen_legacy_job(out_dir: Path, path: Path) -> bool:
    """OUT/job.yaml is batchgen's: in an unmarked folder when it reads as an earlier batchgen's resolved job; in a
    marked one only when the marker recorded it, unchanged, as the folder was marked (a resume of an earlier
    batchgen's output): any other job.yaml in a marked folder is a user's file."""
    if not is_legacy_job_file(path, out_dir):
        return False
    marker = out_dir / MARKER_FILE
    if not marker.exists():
        return True
    try:
        digest = json.loads(marker.read_text()).get(LEGACY_JOB_DIGEST)
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(digest, str) and digest == _sha256(path)


def _starts_with(path: Path, header: str) -> bool:
    try:
        with open(path, errors="replace") as f:
            return f.read(len(header)) == header
    except OSError:
        return False


# the dataset card's first line (output/card.py writes it): a README.md holding it is batchgen's
CARD_MARKER = "<!-- dataset card written by batchgen: `batchgen report` rewrites it -->"


def is_batchgen_card(path: Path) -> bool:
    try:
        return CARD_MARKER in path.read_text(errors="replace")
    except OSError:
        return False


def is_output(out_dir: Path) -> bool:
    """Whether batchgen has used `out_dir` as an output: it holds the marker, or (an output begun before the
    marker existed) a manifest or the resolved job of an earlier batchgen. Before that, every name batchgen
    would write there belongs to someone else."""
    if (out_dir / MARKER_FILE).is_file():
        return True
    mdir = out_dir / "manifest"
    if mdir.is_dir() and any(MANIFEST_NAME.fullmatch(n) for n in os.listdir(mdir)):
        return True
    return (out_dir / LEGACY_JOB_FILE).is_file() and is_legacy_job_file(out_dir / LEGACY_JOB_FILE, out_dir)


def _is_start_entry(name: str) -> bool:
    """What a start writes before the marker (locks, the marker's temporary) and a --fresh in progress."""
    return name in LOCK_FILES or bool(_LOCK.match(name)) or _is_temp_of(name, (MARKER_FILE,)) or \
        name == FRESH_PENDING_DIR or name.startswith(FRESH_DELETING_PREFIX)


def is_batchgen_entry(out_dir: Path, rel: str, owned: bool = True) -> bool:
    """Whether OUT/`rel` (a top-level entry, or a file directly inside one of OWNED_DIRS) is batchgen's. `owned`
    False (is_output said no): only a start's locks and a --fresh in progress are, and OWNED_DIRS are walked."""
    parts = Path(rel).parts
    path = out_dir / rel
    if not owned:
        if len(parts) == 1 and parts[0] in OWNED_DIRS:
            return path.is_dir() and not path.is_symlink()
        return len(parts) == 1 and _is_start_entry(parts[0])
    if len(parts) == 1:
        name = parts[0]
        if name in OWNED_DIRS:
            return path.is_dir() and not path.is_symlink()
        if path.is_dir() and not path.is_symlink():
            return name in (FRESH_PENDING_DIR, QUARANTINE_DIR) or name.startswith(FRESH_DELETING_PREFIX)
        if name == RESOLVED_JOB_FILE:
            return _starts_with(path, RESOLVED_JOB_HEADER)
        if name in TOP_FILES or name in LOCK_FILES or _LOCK.match(name) or _is_temp_of(name, (*TOP_FILES, CARD_FILE)):
            return True
        if name == CARD_FILE:
            return is_batchgen_card(path)
        return name == LEGACY_JOB_FILE and _is_batchgen_legacy_job(out_dir, path)
    if len(parts) != 2 or parts[0] not in OWNED_DIRS or not path.is_file() or path.is_symlink():
        return False
    name = parts[1]
    return _is_tagged(parts[0], name) or (parts[0] == "reports" and (name in REPORT_FILES or
                                                                     _is_temp_of(name, REPORT_FILES)))


def _is_tagged(folder: str, name: str) -> bool:
    """Whether `folder`/`name` is a worker-tagged file batchgen writes there: a shard (a `part-*.parquet.orig`
    beside it is not), a manifest, a throughput log, a worker report, or one's temporary."""
    if folder in SHARD_DIRS:
        return bool(SHARD_NAME.fullmatch(f"{folder}/{name}") or TMP_NAME.fullmatch(name))
    return bool((folder == "manifest" and MANIFEST_NAME.fullmatch(name)) or _TAGGED[folder].fullmatch(name))


def foreign_entries(out_dir: Path) -> list[str]:
    """What lies in `out_dir` that batchgen did not write, as relative paths, sorted (a foreign folder is named
    once, not walked). A user's README.md is not listed: the card leaves it alone, so does --fresh."""
    foreign = []
    owned = is_output(out_dir)
    for name in sorted(os.listdir(out_dir)):
        if name == CARD_FILE and not is_batchgen_card(out_dir / name):
            continue
        if not is_batchgen_entry(out_dir, name, owned):
            foreign.append(name + ("/" if (out_dir / name).is_dir() else ""))
        elif name in OWNED_DIRS:
            for inner in sorted(os.listdir(out_dir / name)):
                rel = f"{name}/{inner}"
                if not is_batchgen_entry(out_dir, rel, owned):
                    foreign.append(rel + ("/" if (out_dir / rel).is_dir() else ""))
    return foreign


def names_taken_before_marking(out_dir: Path) -> list[str]:
    """In a folder batchgen has not used (is_output False): the files a run would write over or mix with, named as
    batchgen names its own (a user's `fingerprint.json`, `reports/index.html`, `data/part-w00000-000000.parquet`).
    Empty for an output, or a folder without such names."""
    if not out_dir.is_dir() or is_output(out_dir):
        return []
    taken = []
    for name in sorted(os.listdir(out_dir)):
        if _is_start_entry(name) or name == CARD_FILE:  # a user's README.md stays: the card never replaces it
            continue
        if name in OWNED_DIRS and (out_dir / name).is_dir():
            taken += [f"{name}/{inner}" for inner in sorted(os.listdir(out_dir / name))
                      if is_batchgen_entry(out_dir, f"{name}/{inner}")]
        elif is_batchgen_entry(out_dir, name):
            taken.append(name)
    return taken


def write_marker(out_dir: Path) -> None:
    """Mark the folder as a batchgen output (written once, whole: a temporary name hard-linked into place)."""
    path = out_dir / MARKER_FILE
    if path.exists():
        return
    record = {"format": "batchgen-output", "version": FORMAT_VERSION}
    legacy = out_dir / LEGACY_JOB_FILE
    if legacy.is_file() and is_legacy_job_file(legacy, out_dir):  # an earlier batchgen's output, marked now
        record[LEGACY_JOB_DIGEST] = _sha256(legacy)  # its job.yaml stays batchgen's while unchanged
    with removed_on_failure(out_dir / f".{MARKER_FILE}.{os.getpid()}.tmp", path) as tmp:
        tmp.write_text(json.dumps(record) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another worker marked it first: same content


def resolved_job_path(out_dir: Path) -> Path:
    """The output's resolved job: job.resolved.yaml; in an unmarked folder without one (an output of an earlier
    batchgen) its job.yaml. May not exist."""
    out_dir = Path(out_dir)
    path = out_dir / RESOLVED_JOB_FILE
    legacy = out_dir / LEGACY_JOB_FILE
    if not path.exists() and legacy.is_file() and not (out_dir / MARKER_FILE).exists():
        return legacy
    return path


def refuse_pending_fresh(out_dir: Path) -> None:
    """JobError when a `--fresh` of this output was interrupted: its files are half moved aside (output/fresh.py),
    and only the next run of the job finishes that; a reader would see shards without records."""
    if (Path(out_dir) / FRESH_PENDING_DIR).is_dir():
        from batchgen.errors import JobError

        raise JobError(f"a `batchgen run --fresh` of {out_dir} was interrupted before it finished; run the job again "
                       f"(with or without --fresh) to finish it, then read the output")

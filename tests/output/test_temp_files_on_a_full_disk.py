"""A full disk during the output's small whole-file writes (marker, resolved job, fingerprint) leaves no temporary
file in the output folder, and the error names the file being written (output/temp_file.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from batchgen.output.temp_file import write_text_atomic
from batchgen.output import fingerprint, layout


def _full_disk_write_text(self: Path, text: str, *args, **kwargs):
    """Path.write_text on a full disk: the file is created and part of it written, then ENOSPC."""
    with open(self, "w") as f:
        f.write(text[: len(text) // 2])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _full_disk_fsync(fd: int):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("what", ["marker", "resolved job", "fingerprint"])
def test_a_full_disk_leaves_no_temporary_file_and_names_the_file_written(tmp_path, monkeypatch, what):
    if what == "fingerprint":
        monkeypatch.setattr(os, "fsync", _full_disk_fsync)
        write, final = (lambda: fingerprint.check_or_write(tmp_path, {"a": 1})), tmp_path / fingerprint.FILE
    else:
        monkeypatch.setattr(Path, "write_text", _full_disk_write_text)
        if what == "marker":
            write, final = (lambda: layout.write_marker(tmp_path)), tmp_path / layout.MARKER_FILE
        else:
            write, final = (lambda: write_text_atomic(tmp_path / "job.resolved.yaml", "x: 1\n" * 100)), \
                tmp_path / "job.resolved.yaml"
    with pytest.raises(OSError) as e:
        write()
    assert e.value.errno == errno.ENOSPC and str(final) in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the file nor its temporary one

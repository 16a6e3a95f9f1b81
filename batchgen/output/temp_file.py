"""How batchgen's small whole-file writes in an output folder (the marker, the resolved job, the fingerprint, the
numerics record, the workers' reports, exports) handle their temporary files: a write that fails (a full disk, a quota)
leaves no temporary file in the user's output folder, and its error names the file being written (a bare
"[Errno 28] No space left on device" said nothing of where)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def removed_on_failure(tmp: Path, final: Path) -> Iterator[Path]:
    """The body writes `tmp` and moves (or links) it into `final`. Whatever happens `tmp` is gone afterwards
    (already moved, or removed), and an OSError raised by the body is raised again naming `final`, errno kept."""
    try:
        yield tmp
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, f"{e.strerror or e} (writing {final})") from e
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # e.g. the file system turned read-only: the body's own error is the one to report
            pass


def write_text_atomic(path: Path, text: str) -> None:
    """`path` replaced whole by `text` (a temporary file beside it, moved into place)."""
    with removed_on_failure(path.with_name(f".{path.name}.tmp{os.getpid()}"), path) as tmp:
        tmp.write_text(text)
        os.replace(tmp, path)

"""Local path or Hugging Face hub name? And if the hub, can it be reached? Both answered in a second or two,
so a typo'd folder or a machine without network is one clear error instead of minutes of retries."""

from __future__ import annotations

import os
import re
from pathlib import Path

from batchgen.errors import JobError

PROBE_TIMEOUT_S = 3.0  # a hub that has not answered by then is treated as unreachable

# What the hub accepts as a repo id: `name` or `namespace/name` (huggingface_hub's validate_repo_id).
_REPO_ID = re.compile(r"^(\b[\w.-]{1,96}\b/)?\b[\w.-]{1,96}\b$")


def looks_local(path: str) -> bool:
    """True for anything that can only mean a local path: absolute, ./ ../ ~, more than one folder level,
    not a valid hub repo id, or whose first folder exists here. A hub id is `name` or `namespace/name`."""
    p = Path(path)
    if p.is_absolute() or path.startswith((".", "~")) or (os.sep != "/" and os.sep in path):
        return True
    if not _REPO_ID.match(path) or "--" in path or ".." in path:
        return True
    return len(p.parts) > 1 and Path(p.parts[0]).exists()


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: libraries read only their local caches."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_unreachable(timeout_s: float | None = None) -> str | None:
    """Why the hub cannot be reached, or None when it answers one HEAD request within the timeout (sent
    through the session, and so the proxies, that huggingface_hub itself uses)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    timeout_s = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout_s)
    except Exception as e:  # DNS failure, refused, timed out, proxy error: all mean "cannot be reached"
        first_line = str(e).splitlines()[0] if str(e) else ""
        return f"no answer within {timeout_s:g} s: {type(e).__name__}{': ' + first_line if first_line else ''}"
    return None


def require_hub(key: str, name: str, local_hint: str) -> None:
    """`name` (the value of job key `key`) is to be fetched from the hub: return when the hub may be asked,
    else raise one line saying why not and how to point at a local copy. With HF_HUB_OFFLINE set this returns
    at once (the caller reads the local cache and reports a miss with `offline_miss`)."""
    from huggingface_hub import constants

    if hub_offline():
        return
    reason = hub_unreachable()
    if reason is not None:
        raise JobError(f"{key} {name!r} is not a local path, and the Hugging Face hub ({constants.ENDPOINT}) "
                       f"cannot be reached ({reason}). {local_hint}; or, if it is in the local Hugging Face "
                       f"cache, set HF_HUB_OFFLINE=1 to use that copy")


def offline_miss(key: str, name: str, local_hint: str) -> JobError:
    """The error for a hub name that is not in the local cache while HF_HUB_OFFLINE is set."""
    return JobError(f"{key} {name!r} is not a local path, and HF_HUB_OFFLINE is set, so the Hugging Face hub is "
                    f"not asked and the local cache has no copy. {local_hint}; or unset HF_HUB_OFFLINE on a "
                    f"machine that reaches the hub")

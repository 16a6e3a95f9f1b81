"""Fingerprint: what decides the output (model, tokenizer, chat template, prompt, sampling, row identity,
batchgen version, engine.deterministic, engine.kv_cache_dtype: fp8, engine.max_model_len). Resuming into a
directory whose fingerprint differs is refused, naming what changed; the other engine knobs (batch size, memory,
graphs) are not part of it and may change freely.
engine.deterministic is: a dataset half made with batch-invariant kernels and half without is reproducible for
no one."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from batchgen.errors import JobError
from batchgen.config import JobSpec
from batchgen.output.damage import FINGERPRINT_FIX, load_json
from batchgen.output.temp_file import removed_on_failure

FILE = "fingerprint.json"


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def components(spec: JobSpec, model_config: dict, tokenizer, version: str) -> dict[str, Any]:
    vocab = sorted(tokenizer.get_vocab().items())
    return {
        "batchgen_version": version,
        "model": {"path": spec.model.path, "gguf_file": spec.model.gguf_file, "dtype": spec.model.dtype,
                  "config": _digest({k: v for k, v in model_config.items() if not k.startswith("_")})},
        "tokenizer": {"vocab": _digest(vocab), "special_tokens": _digest(tokenizer.all_special_tokens)},
        "chat_template": _digest(getattr(tokenizer, "chat_template", None)),
        "prompt": spec.prompt.model_dump(mode="json"),
        "sampling": _sampling(spec),
        "row_identity": {"key_column": spec.source.key_column},
        "sampling_column": spec.source.sampling_column,  # per-row sampling overrides (None for most jobs)
        # the data shards' columns: shards of one output must share one schema
        # (reasoning and logprob_tokens recorded only when on, so outputs begun before them compare unchanged)
        "output_columns": {**spec.output.model_dump(include={"keep_columns", "keep_prompt", "keep_token_ids"}),
                           **({} if spec.output.reasoning == "none" else
                              {"reasoning": spec.output.model_dump(mode="json")["reasoning"]}),
                           **({"logprob_tokens": True} if spec.output.logprob_tokens else {})},
        # a chained job: what decided its source, the upstream output (None for any other source)
        "upstream": upstream_fingerprint(spec.source.path),
        # the numerics: batch-invariant kernels or the default ones, and an fp8 K/V cache (engine/config.py);
        # kv_cache_dtype recorded only when fp8, so outputs begun before it (or without it) compare unchanged
        "engine": {"deterministic": spec.engine.deterministic,
                   **({"kv_cache_dtype": "fp8"} if spec.engine.kv_cache_dtype == "fp8" else {})},
        # the context a sequence may fill: it decides which prompts are too long (or how they are cut) and where a
        # completion stops; a component of its own, so that outputs begun before it resume unchanged
        "max_model_len": _context(spec, model_config),
    }


def own_context(model_config: dict) -> int | None:
    """The model's own context (max_position_embeddings, as EngineConfig.context_length reads it), from the config
    dict components() takes; None when the config names none."""
    text = model_config.get("text_config") or model_config
    return text.get("max_position_embeddings")


def _context(spec: JobSpec, model_config: dict) -> int | None:
    """engine.max_model_len as recorded: None for the model's own context, unset or set to the same number (one
    context, one record: a resume that spells it out is the same job)."""
    own = own_context(model_config)
    return None if spec.engine.max_model_len == own else spec.engine.max_model_len


# sampling settings added after outputs existed: recorded only when set, so an output begun before them (or
# without them) resumes, and turning one on (or changing it) is refused
SAMPLING_OFF = {"logprobs": None, "prompt_logprobs": False, "thinking_budget": None, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "logit_bias": [],
                "response_format": None, "response_format_column": None}  # structured output


def _sampling(spec: JobSpec) -> dict[str, Any]:
    dump = spec.sampling.model_dump(mode="json")
    return {k: v for k, v in dump.items() if not (k in SAMPLING_OFF and v == SAMPLING_OFF[k])}


def upstream_fingerprint(source_path: str | list[str]) -> str | None:
    """The digest of an upstream batchgen output's fingerprint, when the source is one."""
    if not isinstance(source_path, str):
        return None
    path = Path(source_path) / FILE
    if not (Path(source_path) / "manifest").is_dir() or not path.is_file():
        return None
    return _digest(stored_components(path))


def stored_components(path: Path) -> dict[str, Any]:
    """The components recorded in a fingerprint.json; JobError naming it when it is damaged."""
    stored = load_json(path, FINGERPRINT_FIX)
    if not isinstance(stored, dict) or not isinstance(stored.get("components"), dict):
        raise JobError(f"{path} is damaged (it holds no `components` object); {FINGERPRINT_FIX}")
    return stored["components"]


# components added after 0.1.0's first outputs, with the value that means "off" (an output begun before them was)
OFF_WHEN_ABSENT = {"sampling_column": None, "upstream": None, "engine": {"deterministic": False}}


def _diff(old: Any, new: Any, path: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            out += _diff(old.get(k), new.get(k), f"{path}.{k}" if path else k)
        return out
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def refusal(out_dir: Path, current: dict[str, Any], own: int | None = None) -> str | None:
    """Why resuming into `out_dir` with these components must be refused (None: it may resume, or nothing is
    recorded yet). Reads only. A component that the stored fingerprint predates (an output begun by an
    earlier batchgen) is not compared, except those of OFF_WHEN_ABSENT, which compare as off."""
    path = out_dir / FILE
    if not path.exists():
        return None
    stored = stored_components(path)
    current = json.loads(json.dumps(current, default=str))
    # A component the stored fingerprint predates was off then: it compares as off, so an upgrade alone
    # never blocks a resume, and turning the new setting on does.
    stored = {**{k: off for k, off in OFF_WHEN_ABSENT.items() if k in current}, **stored}
    if own is not None and stored.get("max_model_len") == own:  # recorded as a number before it was normalised
        stored["max_model_len"] = None
    comparable = {k: v for k, v in current.items() if k in stored}
    changes = _diff(stored, comparable, "")
    if not changes:
        return None
    return (f"refusing to resume into {out_dir}: what decides the output changed since it was started:\n  - "
            + "\n  - ".join(changes)
            + "\nRevert the change, pick another output.dir (or --output), or pass --fresh to start over "
              "(deletes this directory's results).")


def check_or_write(out_dir: Path, current: dict[str, Any], own: int | None = None) -> None:
    """First run: record the fingerprint. Later runs: refuse if it changed (see `refusal`; `own`: the model's own
    context, own_context())."""
    path = out_dir / FILE
    if path.exists():
        message = refusal(out_dir, current, own)
        if message is not None:
            raise JobError(message)
        return
    # a temporary file of this call's own: the workers of a job start together and each writes the (same)
    # fingerprint; with one shared temporary name, one worker's rename took the file another was writing
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{FILE}.", suffix=".tmp")
    with removed_on_failure(Path(tmp), path):
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would make it the one file of the output others cannot read
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"fingerprint": _digest(current), "components": current}, indent=2, default=str))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

"""OpenAI batch input files (`source.type: openai_batch`; inferred for a .jsonl file whose first line has
`custom_id` and `body`): one request a line, `{custom_id, method: POST, url, body}`.

Each line becomes a row with columns `custom_id` (the row key), `messages` (url /v1/chat/completions) or
`prompt` (url /v1/completions), and `sampling`: the body's generation fields mapped onto the job's `sampling:`
names, which `source.sampling_column` applies per row (job/row_sampling.py), so a bad or unsupported value
rejects that line as `bad_sampling` naming the field. Mapped: max_tokens / max_completion_tokens ->
max_new_tokens, temperature, top_p, n, stop, seed, presence_penalty, frequency_penalty. A non-empty logit_bias
rejects its line: its keys are ids of OpenAI's tokenizers, not of the job's model. Accepted and ignored: model
(every line runs the job's model; one notice), user, metadata, store, stream: false, logprobs false,
response_format {type: text}. Honoured (structured output): response_format {type: json_object} and
{type: json_schema, json_schema: {name, schema, strict}} -> the row's response_format (the schema; name and
strict are not needed: every completion follows the schema). Anything else is passed on as `body.<name>` and
rejects its line naming that field.
A line that is not such a request (not JSON, no custom_id or body, another method or endpoint than the
file's first line) is a `malformed_row` reject.
Bounded: a body.n above OpenAI's own limit (MAX_N) rejects its line as `bad_sampling` naming n (each sample
holds a sequence: a line asking for a million would exhaust the host). A message's content may be a list of
content parts: text parts are joined (prompts.py join_text_parts); a line whose messages hold another part type
(image_url, input_audio, file) keeps it, and the prompt renderer rejects it as `bad_messages` naming the part.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from batchgen.errors import JobError
from batchgen.sampling_params import SamplingParams
from batchgen.config import SourceSpec
from batchgen.sources.base import Source, SourceRow
from batchgen.sources.jsonl import JsonlSource

ENDPOINTS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}  # url -> the prompt's column
RENAMED = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
MAPPED = {"temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty"}
IGNORED = {"model", "user", "metadata", "store", "messages", "prompt"}
MAX_N = 128  # OpenAI's limit on a request's n
NEUTRAL = {"stream": (False, None), "presence_penalty": (None,), "frequency_penalty": (None,), "logit_bias": (None, {}),
           "logprobs": (False, None), "top_logprobs": (0, None)}


def sniff(path: str) -> str | None:
    """The prompt column ("messages" or "prompt") if the file's first line is an OpenAI batch request."""
    if not path.lower().endswith((".jsonl", ".ndjson")) or not Path(path).is_file():
        return None
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    return None
                if isinstance(first, dict) and "custom_id" in first and isinstance(first.get("body"), dict):
                    return ENDPOINTS.get(first.get("url"), "messages")
                return None
    return None


def body_sampling(body: dict) -> dict:
    """The body's generation fields as `sampling:` fields (unsupported ones under their own names)."""
    out = {}
    for name, value in body.items():
        if name in IGNORED or (name in NEUTRAL and value in NEUTRAL[name]):
            continue
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        if name == "logit_bias":  # ids of OpenAI's tokenizers mean other tokens here: refused by its own name
            name = "logit_bias (its keys are OpenAI token ids, not this model's)"
        if name == "response_format":
            value = _response_format(value)
        if name == "n" and isinstance(value, (int, float)) and value > MAX_N:  # refused by name, never allocated
            name = f"n ({value} is more than {MAX_N}, OpenAI's own limit on n)"
        name = RENAMED.get(name, name)
        if name not in SamplingParams.model_fields and " " not in name:
            name = f"body.{name}"  # unsupported: its reject names the request's own field (body.tools)
        out[name] = value
    return out


def _response_format(value):
    """OpenAI's response_format as batchgen's: json_object as it is; json_schema's {name, schema, strict} wrapper
    unwrapped to the schema (without one: no json_schema, which rejects the line naming it). Anything else is
    passed on unchanged (SamplingParams names what is wrong)."""
    wrapper = value.get("json_schema") if isinstance(value, dict) else None
    if not isinstance(wrapper, dict) or value.get("type") != "json_schema":
        return value
    return {"type": "json_schema", **({"json_schema": wrapper["schema"]} if "schema" in wrapper else {})}


def _text_contents(messages):
    """Chat messages with each content of text parts joined into one string; a message with another part type
    (or anything that is not a list of messages) is left as it is, for the renderer to reject by name."""
    from batchgen.prompts import join_text_parts

    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            try:
                m = {**m, "content": join_text_parts(m["content"])}
            except ValueError:
                return messages
        out.append(m)
    return out


class OpenAIBatchSource(Source):
    typed = False

    def __init__(self, files: list[str], spec: SourceSpec) -> None:
        super().__init__(spec.limit, spec.key_column)
        self.lines = JsonlSource(files, spec.model_copy(update={"key_column": None, "type": "jsonl"}))
        self.files = files
        self.description = f"OpenAI batch file(s) ({files[0]}{', ...' if len(files) > 1 else ''})"
        self.prompt_column = sniff(files[0])
        if self.prompt_column is None:
            raise JobError(f"{files[0]} is not an OpenAI batch file: its first line needs custom_id and body")
        self.url = next(u for u, c in ENDPOINTS.items() if c == self.prompt_column)
        prompt_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])) \
            if self.prompt_column == "messages" else pa.string()
        self.schema = pa.schema([("custom_id", pa.string()), (self.prompt_column, prompt_type),
                                 ("sampling", pa.string())])
        self.num_rows = None
        self.check_key_column()

    def count_rows(self) -> int:
        return self.lines.count_rows()

    def progress_rows(self) -> int | None:
        return self.lines.progress_rows()

    def _iter_all(self) -> Iterator[SourceRow]:
        told_model = False
        for row in self.lines:
            if row.columns is None:
                yield row
                continue
            line, error = row.columns, None
            body = line.get("body")
            if "custom_id" not in line or not isinstance(body, dict):
                error = "not an OpenAI batch request: it needs custom_id and a body object"
            elif line.get("method", "POST") != "POST":
                error = f"method {line.get('method')!r}: batch requests are POST"
            elif line.get("url", self.url) != self.url:
                error = f"url {line.get('url')!r}: this file's requests go to {self.url} (its first line's)"
            elif self.prompt_column not in body:
                error = f"body has no {self.prompt_column!r} for {self.url}"
            if error is not None:
                custom_id = line.get("custom_id")
                yield SourceRow(row.position, None, error, key=None if custom_id is None else str(custom_id))
                continue
            if not told_model and "model" in body:
                told_model = True
                print(f"batchgen: the requests' body.model ({body['model']!r}) is ignored: every line runs the "
                      f"job's model", file=sys.stderr)
            yield SourceRow(row.position, {"custom_id": str(line["custom_id"]),
                                           self.prompt_column: _text_contents(body[self.prompt_column]),
                                           "sampling": json.dumps(body_sampling(body))})

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
file's first line) is a `malformed_row` reject naming its file and line. So is a line whose custom_id is not a
non-empty string (null, a number, an object, ""): like a line without one, it is keyed by its position, never by
the text of a value OpenAI would refuse ("None", "5").
The prompt is checked here, so a line's outcome never depends on output.keep_columns (the messages column's
type is fixed: {role, content} turns): a `malformed_row` reject names the field. /v1/completions: body.prompt is
a string, or a list of one string (OpenAI's one prompt: the same request); a list of several prompts, token ids
(OpenAI's tokenizers' ids) or any other value rejects the line naming body.prompt. /v1/chat/completions:
body.messages is a list of messages {role, content}; role system, developer, user or assistant (tool and function
results and any other role reject the line naming body.messages[i].role); content a string or a list of content
parts (null or missing rejects naming body.messages[i].content); a message's `name` is dropped (the prompt renderer
hands the chat template role and content only); any other field of a message that is not null (tool_calls,
function_call, tool_call_id, audio, refusal, ...) rejects the line naming body.messages[i].<field>.
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


ROLES = ("system", "developer", "user", "assistant")  # a chat message's roles batchgen generates from
MESSAGE_FIELDS = {"role", "content", "name"}  # name: dropped (the renderer hands the template role and content)


def _what(value) -> str:
    """A JSON value's kind, for a message naming what a field holds."""
    return "null" if value is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def _prompt(prompt) -> tuple[str | None, str | None]:
    """/v1/completions: body.prompt as the row's prompt text, or why the line is rejected (naming body.prompt).
    A list of one string is that string (OpenAI: one prompt, one request); several prompts, token ids or
    anything else is refused."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0], None
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return None, (f"body.prompt holds a list of {len(prompt)} prompts: batchgen generates one prompt per "
                      f"line; give each prompt its own line (its own custom_id)")
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, int) and not isinstance(p, bool) or
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        return None, ("body.prompt holds token ids: they are ids of OpenAI's tokenizers, not of the job's model; "
                      "send the prompt as text")
    return None, (f"body.prompt holds {_what(prompt) if prompt != [] else 'an empty list'}: it must be the prompt's "
                  f"text (a string)")


def _messages(messages) -> tuple[list | None, str | None]:
    """/v1/chat/completions: body.messages as the row's {role, content} turns (text content parts joined:
    prompts.py join_text_parts; a content of other parts is kept for the renderer to reject as bad_messages), or
    why the line is rejected, naming the field (body.messages[i].tool_calls)."""
    from batchgen.prompts import join_text_parts

    if not isinstance(messages, list):
        return None, f"body.messages holds {_what(messages)}: it must be a list of messages {{role, content}}"
    out = []
    for i, m in enumerate(messages):
        at = f"body.messages[{i}]"
        if not isinstance(m, dict):
            return None, f"{at} holds {_what(m)}: a message is an object {{role, content}}"
        role = m.get("role")
        if role in ("tool", "function"):
            return None, (f"{at}.role is {role!r}: tool and function results are not supported (batchgen does "
                          f"not call tools); supported roles: {', '.join(ROLES)}")
        if role not in ROLES:
            return None, (f"{at}.role is {'missing' if 'role' not in m else repr(role)}: supported roles: "
                          f"{', '.join(ROLES)}")
        for field, value in m.items():
            if field not in MESSAGE_FIELDS and value is not None:
                return None, (f"{at}.{field} is not supported: batchgen generates from each message's role and "
                              f"content only (no tool calls, function calls, audio or refusals)")
        if m.get("name") is not None and not isinstance(m["name"], str):
            return None, f"{at}.name holds {_what(m['name'])}: it must be a string"
        content = m.get("content")
        if isinstance(content, list):
            try:
                content = join_text_parts(content)
            except ValueError:
                pass  # another part type (image_url, ...): the renderer rejects it as bad_messages, naming it
        elif not isinstance(content, str):
            return None, (f"{at}.content is {'missing' if 'content' not in m else _what(content)}: a {role} "
                          f"message needs its text (a string or a list of text parts)")
        out.append({"role": role, "content": content})
    return out, None


def _custom_id_error(custom_id) -> str | None:
    """Why a custom_id cannot key its line (OpenAI's are non-empty strings), or None."""
    if isinstance(custom_id, str) and custom_id:
        return None
    return (f"custom_id holds {_what(custom_id) if custom_id != '' else 'an empty string'}: it must be a "
            f"non-empty string (the line is keyed by its position)")


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
        from batchgen.sources.jsonl import parse_line

        told_model = False
        for position, (path, number, text) in enumerate(self.lines.nonblank_lines()):  # JsonlSource's lines
            line, error = parse_line(text)
            if line is None:  # not JSON (a UnicodeDecodeError's reason names its line already), as JsonlSource
                yield SourceRow(position, None, error if isinstance(text, UnicodeDecodeError) else
                                f"line {number} of {path}: {error}")
                continue
            body, custom_id, prompt = line.get("body"), line.get("custom_id"), None
            if "custom_id" not in line or not isinstance(body, dict):
                error = "not an OpenAI batch request: it needs custom_id and a body object"
            elif _custom_id_error(custom_id) is not None:  # null, 5, "": no key (never "None" or "5")
                error = _custom_id_error(custom_id)
            elif line.get("method", "POST") != "POST":
                error = f"method {line.get('method')!r}: batch requests are POST"
            elif line.get("url", self.url) != self.url:
                error = f"url {line.get('url')!r}: this file's requests go to {self.url} (its first line's)"
            elif self.prompt_column not in body:
                error = f"body has no {self.prompt_column!r} for {self.url}"
            else:
                prompt, error = (_messages if self.prompt_column == "messages" else _prompt)(body[self.prompt_column])
            if error is not None:  # keyed by its custom_id where that is one, else by its position
                yield SourceRow(position, None, f"line {number} of {path}: {error}",
                                key=custom_id if _custom_id_error(custom_id) is None else None)
                continue
            if not told_model and not self.quiet and "model" in body:
                told_model = True
                print(f"batchgen: the requests' body.model ({body['model']!r}) is ignored: every line runs the "
                      f"job's model", file=sys.stderr)
            yield SourceRow(position, {"custom_id": custom_id, self.prompt_column: prompt,
                                       "sampling": json.dumps(body_sampling(body))})

"""Prompt rendering: a Jinja2 template over the row's columns, a prompt column, or a messages column;
optional system prompt; the tokenizer's chat template; then token ids, truncated or rejected when too long.

Templates run in Jinja2's immutable sandbox (as transformers runs chat templates): a job file from someone
else cannot reach Python internals through it. A null column is undefined to the template: using it rejects
the row as `null_value`, unless the template gives a default (`{{ topic | default('a topic') }}`).

Bounded (the job's `limits:`, sandbox.py): a template render's steps and sizes, every render's wall time, the
chat template's output and the prompt's characters before tokenizing. A row over a limit is a reject; a
template over a limit on each of the first FAIL_FAST_ROWS rows it renders (none rendered before) stops the job:
then it is the template, not the rows. A message's content may be a list of OpenAI content parts: its text
parts are joined (TEXT_PART_SEPARATOR); a part of another type rejects the row as `bad_messages`."""

from __future__ import annotations

from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import SecurityError

from batchgen.errors import JobError, RowError
from batchgen.config import PromptSpec
from batchgen.sandbox import BoundedSandbox, RenderLimitError, deadline

__all__ = ["PromptRenderer", "RowError", "join_text_parts"]

FAIL_FAST_ROWS = 3
TEXT_PART_SEPARATOR = "\n"  # between the text parts of one message's content (as vLLM joins them)


def join_text_parts(content: Any) -> Any:
    """A message's content as text: a list of {type: text, text} parts joined; anything but a list as it is.
    ValueError naming the first part that is not text."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"content part {j} is of type {kind!r}: only text parts ({{type: text, text}}) can "
                             f"be generated from")
        texts.append(part["text"])
    return TEXT_PART_SEPARATOR.join(texts)


class NullColumnError(jinja2.UndefinedError):
    """The template used a column that is null in this row (and gave no default)."""


def _null_column(name: str) -> jinja2.StrictUndefined:
    # Undefined to the template, so `default` and `is defined` see it as missing; any other use raises.
    return jinja2.StrictUndefined(hint=f"column {name!r} is null in this row (to render a null, give the template "
                                       f"a default: {{{{ {name} | default('...') }}}})",
                                  name=name, exc=NullColumnError)


class PromptRenderer:
    def __init__(self, spec: PromptSpec, tokenizer, columns: list[str], max_prompt_tokens: int) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.limits = spec.limits
        self._env = BoundedSandbox(self.limits.max_render_steps, self.limits.max_prompt_chars)
        self._template = None
        self._num_rendered = 0  # renders that passed every limit
        self._num_over_limit = 0  # renders that went over one
        if spec.template is not None:
            try:
                self._template = self._env.bounded_template(spec.template)
                names = jinja2.meta.find_undeclared_variables(self._env.parse(spec.template))
            except jinja2.TemplateAssertionError as e:
                raise JobError(f"prompt.template line {e.lineno}: {e.message}") from None
            except jinja2.TemplateSyntaxError as e:
                raise JobError(f"prompt.template has a Jinja2 syntax error at line {e.lineno}: {e.message}") from None
            missing = sorted(names - set(columns))
            if missing:
                raise JobError(f"prompt.template uses {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                               f"not a column of the source; columns: {', '.join(columns)}")
        for key in ("column", "messages_column"):
            name = getattr(spec, key)
            if name is not None and name not in columns:
                raise JobError(f"prompt.{key} {name!r} is not a column of the source; columns: {', '.join(columns)}")
        if spec.chat and not getattr(tokenizer, "chat_template", None):
            raise JobError("prompt.chat is true but the tokenizer has no chat template; set prompt.chat: false "
                           "to feed the rendered text as is")

    def render(self, row: dict[str, Any]) -> str:
        """The prompt text (after the chat template when chat is on)."""
        try:
            try:
                with deadline(self.limits.render_timeout_s, "rendering the prompt"):
                    text = self._render(row)
            except RenderLimitError as e:  # the deadline, where no handler below turned it into a reject
                raise RowError("template_error" if self._template is not None else "chat_template_error",
                               f"rendering the prompt went over a limit on this row: {e}") from e
        except RowError as e:
            if e.error_class in ("template_error", "chat_template_error") and isinstance(e.__cause__,
                                                                                         RenderLimitError):
                self._over_limit(e)
            raise
        self._num_rendered += 1
        return text

    def _over_limit(self, e: RowError) -> None:
        self._num_over_limit += 1
        if self._num_rendered == 0 and self._num_over_limit >= FAIL_FAST_ROWS:
            key = "prompt.template" if e.error_class == "template_error" else "the model's chat template"
            raise JobError(f"{key} went over a limit on each of the first {FAIL_FAST_ROWS} rows it rendered: "
                           f"{e.__cause__}. It is the template, not the rows: fix it (or raise the limit in the "
                           f"job's limits: section)") from None

    def _render(self, row: dict[str, Any]) -> str:
        spec = self.spec
        if spec.messages_column is not None:
            messages = self._messages(row.get(spec.messages_column))
        else:
            if self._template is not None:
                text = self._render_template(row)
            else:
                value = row.get(spec.column)
                if value is None:
                    raise RowError("null_value", f"column {spec.column!r} is null")
                if isinstance(value, bytes):
                    value = value.decode("utf-8", errors="replace")
                text = value if isinstance(value, str) else str(value)
            if not text.strip():
                raise RowError("empty_prompt", "the rendered prompt is empty")
            if not spec.chat:
                return text if spec.system is None else f"{spec.system}\n\n{text}"
            messages = [{"role": "user", "content": text}]
        if spec.system is not None and (not messages or messages[0].get("role") != "system"):
            messages = [{"role": "system", "content": spec.system}, *messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **spec.chat_template_kwargs)
            if len(text) > self.limits.max_prompt_chars:
                raise RenderLimitError(f"the chat template's output is {len(text)} characters long, more than "
                                       f"limits.max_prompt_chars ({self.limits.max_prompt_chars})")
            return text
        except RenderLimitError as e:
            raise RowError("chat_template_error", f"the chat template went over a limit on this row: {e}") from e
        except RecursionError:
            raise RowError("chat_template_error", "the chat template recursed too deeply on this row") from None
        except Exception as e:  # jinja2 errors, raise_exception() in templates, bad message shapes
            raise RowError("chat_template_error", f"the chat template failed on this row: {type(e).__name__}: {e}") \
                from None

    def _render_template(self, row: dict[str, Any]) -> str:
        values = {k: _null_column(k) if v is None else v for k, v in row.items()}
        try:
            return self._env.render(self._template, values)
        except RenderLimitError as e:
            raise RowError("template_error", f"prompt.template went over a limit on this row: {e}") from e
        except (OverflowError, RecursionError, MemoryError) as e:  # Jinja2's own range cap, macros calling macros
            raise RowError("template_error", f"prompt.template went over a limit on this row: "
                                             f"{type(e).__name__}: {e}") from RenderLimitError(str(e))
        except NullColumnError as e:
            raise RowError("null_value", f"prompt.template: {e}") from None
        except SecurityError as e:
            # The template's doing, not the row's: a row-by-row reject would hide it in rejects/.
            raise JobError(f"prompt.template is not allowed (template_error): {e} Templates run in Jinja2's "
                           f"sandbox: they may use the row's columns, filters and tests, not Python attributes "
                           f"starting with _ or methods that change a value; fix the template") from None
        except jinja2.TemplateError as e:
            raise RowError("template_error", f"prompt.template failed on this row: {e}") from None

    def _messages(self, value: Any) -> list[dict]:
        if value is None:
            raise RowError("null_value", f"column {self.spec.messages_column!r} is null")
        if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                  for m in value):
            raise RowError("bad_messages", f"column {self.spec.messages_column!r} must hold a list of "
                                           f"{{role, content}} messages, got {str(value)[:200]}")
        if not value:
            raise RowError("empty_prompt", "the messages list is empty")
        messages = []
        for i, m in enumerate(value):
            try:
                messages.append({"role": m["role"], "content": join_text_parts(m["content"])})
            except ValueError as e:
                raise RowError("bad_messages", f"column {self.spec.messages_column!r}: message {i}: {e}") from None
        return messages

    def tokenize(self, text: str) -> list[int]:
        """Token ids; over-long prompts are truncated or rejected per prompt.on_too_long (a text longer than
        limits.max_prompt_chars: cut to that many characters first, or rejected, before the tokenizer sees it)."""
        max_chars = self.limits.max_prompt_chars
        if len(text) > max_chars:
            policy = self.spec.on_too_long
            if policy == "reject":
                raise RowError("prompt_too_long", f"the prompt has {len(text)} characters, more than "
                                                  f"limits.max_prompt_chars ({max_chars}); set prompt.on_too_long "
                                                  f"to truncate")
            text = text[-max_chars:] if policy == "truncate_left" else text[:max_chars]
        ids = self.tokenizer.encode(text, add_special_tokens=not self.spec.chat)
        if not ids:
            raise RowError("empty_prompt", "the prompt has no tokens")
        limit = self.max_prompt_tokens
        if len(ids) > limit:
            policy = self.spec.on_too_long
            if policy == "truncate_left":
                return ids[-limit:]
            if policy == "truncate_right":
                return ids[:limit]
            raise RowError("prompt_too_long", f"the prompt has {len(ids)} tokens, more than the {limit} allowed "
                                              f"(model context minus sampling.max_new_tokens, or "
                                              f"prompt.max_prompt_tokens); set prompt.on_too_long to truncate")
        return ids

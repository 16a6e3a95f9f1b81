"""Prompt rendering: a Jinja2 template over the row's columns, a prompt column, or a messages column;
optional system prompt; the tokenizer's chat template; then token ids, truncated or rejected when too long.

Templates run in Jinja2's immutable sandbox (as transformers runs chat templates): a job file from someone
else cannot reach Python internals through it. A null column is undefined to the template: using it rejects
the row as `null_value`, unless the template gives a default (`{{ topic | default('a topic') }}`)."""

from __future__ import annotations

from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from batchgen.errors import JobError, RowError
from batchgen.job.spec import PromptSpec

__all__ = ["PromptRenderer", "RowError"]


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
        self._env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        self._template = None
        if spec.template is not None:
            try:
                self._template = self._env.from_string(spec.template)
                names = jinja2.meta.find_undeclared_variables(self._env.parse(spec.template))
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
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **spec.chat_template_kwargs)
        except Exception as e:  # jinja2 errors, raise_exception() in templates, bad message shapes
            raise RowError("chat_template_error", f"the chat template failed on this row: {type(e).__name__}: {e}") \
                from None

    def _render_template(self, row: dict[str, Any]) -> str:
        values = {k: _null_column(k) if v is None else v for k, v in row.items()}
        try:
            return self._template.render(**values)
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
        return [{"role": m["role"], "content": m["content"]} for m in value]

    def tokenize(self, text: str) -> list[int]:
        """Token ids; over-long prompts are truncated or rejected per prompt.on_too_long."""
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

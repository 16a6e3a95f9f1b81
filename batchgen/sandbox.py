"""The bounded Jinja2 sandbox prompt templates run in: Jinja2's immutable sandbox (no Python internals, no
mutating methods), plus bounds on what one render may cost, so a template cannot hang a job or exhaust memory.

Bounds of one render (RenderLimitError names the `limits:` key to raise):
  * steps: every loop iteration and every call (macros, methods, globals) counts one; at most `max_steps`.
    Loops are counted by wrapping each `{% for %}`'s iterable (`bounded_iter`) in the parsed template.
  * size: no string or list the template builds (`*`, `+`, `~`, `%`, join, replace, padding widths) may exceed
    `max_chars` items, checked before it is built; the output is streamed and stops at `max_chars` characters.
  * range(): at most `max_steps` items.
  * `{% include %}`, `{% import %}`, `{% extends %}`: refused when the template is compiled (there are no files
    to load; a template is one string).
  * the wall-clock deadline of every render (`deadline`): SIGALRM, main thread only; elsewhere not armed.
Invariant: `steps` is reset by `render` only; the optimizer is off, so no expression is evaluated at compile time
outside these checks.
Residual hazard: a single C-level call with a size the checks do not see (a `{:>N}` width taken from a
variable) can still allocate before the output cap stops it.
"""

from __future__ import annotations

import functools
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

FORBIDDEN = {nodes.Include: "{% include %}", nodes.Import: "{% import %}", nodes.FromImport: "{% from ... import %}",
             nodes.Extends: "{% extends %}"}
SIZED_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs"}  # str methods whose int argument is a size
MAX_INT_BITS = 1 << 16  # `**` results larger than this many bits are refused
_PERCENT_WIDTH = re.compile(r"%[-#0 +]*(\d+)?(?:\.(\d+))?")
_BRACE_WIDTH = re.compile(r"\{[^{}]*:[^{}\d]*(\d+)?(?:\.(\d+))?[^{}]*\}")


class RenderLimitError(jinja2.TemplateRuntimeError):
    """A render went over one of its bounds; the message names the `limits:` key."""


class RenderTimeout(RenderLimitError):
    pass


def _too_long(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise RenderLimitError(f"{what} would be {n} long, more than limits.max_prompt_chars ({limit})")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, max_steps: int, max_chars: int) -> None:
        super().__init__(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, optimized=False)
        self.max_steps = max_steps
        self.max_chars = max_chars
        self.steps = 0
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["range"] = self._range

    # ---- compiling ---------------------------------------------------------------------------------
    def bounded_template(self, source: str) -> jinja2.Template:
        """The template with its loops counted and its `~` concatenations sized; TemplateSyntaxError as Jinja2
        raises it; TemplateAssertionError for a tag that loads another template."""
        tree = self.parse(source)
        for kind, tag in FORBIDDEN.items():
            node = tree.find(kind)
            if node is not None:
                raise jinja2.TemplateAssertionError(f"{tag} is not available: a prompt template is one string "
                                                    f"with no other files to load; write the text in", node.lineno)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"), [loop.iter], [], None, None,
                                   lineno=loop.lineno)
        for parent in tree.find_all(nodes.Node):
            for field in parent.fields:
                value = getattr(parent, field, None)
                if isinstance(value, nodes.Concat):
                    setattr(parent, field, self._sized_concat(value))
                elif isinstance(value, list):
                    setattr(parent, field, [self._sized_concat(v) if isinstance(v, nodes.Concat) else v
                                            for v in value])
        tree.set_environment(self)
        return self.from_string(tree)

    @staticmethod
    def _sized_concat(node: nodes.Concat) -> nodes.Call:
        return nodes.Call(nodes.EnvironmentAttribute("bounded_concat"), [nodes.List(node.nodes, lineno=node.lineno)],
                          [], None, None, lineno=node.lineno)

    # ---- rendering ---------------------------------------------------------------------------------
    def render(self, template: jinja2.Template, values: dict) -> str:
        """The template's text; RenderLimitError past a bound."""
        self.steps = 0
        parts, length = [], 0
        for piece in template.generate(**values):
            length += len(piece)
            if length > self.max_chars:
                raise RenderLimitError(f"the rendered prompt is longer than limits.max_prompt_chars "
                                       f"({self.max_chars} characters)")
            parts.append(piece)
        return "".join(parts)

    def _step(self) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise RenderLimitError(f"the template took more than limits.max_render_steps ({self.max_steps}) loop "
                                   f"iterations and calls for one row")

    def bounded_iter(self, iterable) -> Iterator:
        for item in iterable:
            self._step()
            yield item

    def bounded_concat(self, parts: list) -> str:
        texts = [str(p) for p in parts]
        _too_long(sum(map(len, texts)), self.max_chars, "a `~` concatenation")
        return "".join(texts)

    def _range(self, *args) -> range:
        r = range(*args)
        if len(r) > self.max_steps:
            raise RenderLimitError(f"range() of {len(r)} items is more than limits.max_render_steps "
                                   f"({self.max_steps})")
        return r

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja2's own signature)
        __self._step()
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            if name == "join" and args and not isinstance(args[0], (str, list, tuple)):
                args = (list(args[0]), *args[1:])  # sized below, then joined: an iterator is consumed once
            __self._check_str_method(owner, name, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator: str, left, right):
        sized = (str, list, tuple)
        if operator == "*":
            seq, times = (left, right) if isinstance(left, sized) else (right, left)
            if isinstance(seq, sized) and isinstance(times, int):
                _too_long(len(seq) * times, self.max_chars, f"a `*` of a {type(seq).__name__}")
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            _too_long(len(left) + len(right), self.max_chars, f"a `+` of {type(left).__name__}s")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if max(abs(left).bit_length(), 1) * right > MAX_INT_BITS and abs(left) > 1:
                raise RenderLimitError(f"{left} ** {right} is a number of more than {MAX_INT_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            self._check_format(left, _PERCENT_WIDTH, right if isinstance(right, tuple) else (right,))
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value):
        """str.format / format_map, as the sandbox wraps them: widths in the format, and, where a width is itself
        a field (`{:>{}}`), the int arguments, sized first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def sized(*args, **kwargs):
            self._check_format(fmt, _BRACE_WIDTH, ())
            if re.search(r"\{[^{}]*\{", fmt):
                values = [*args, *kwargs.values(), *(args[0].values() if args and isinstance(args[0], dict) else ())]
                _too_long(max([v for v in values if isinstance(v, int)], default=0), self.max_chars, "a format width")
            return wrapped(*args, **kwargs)

        return sized

    # ---- sizes of calls ----------------------------------------------------------------------------
    def _check_format(self, fmt: str, pattern: re.Pattern, args) -> None:
        widths = [int(n) for m in pattern.finditer(fmt) for n in m.groups() if n]
        if "*" in fmt:
            widths += [a for a in args if isinstance(a, int)]
        if widths:
            _too_long(max(widths), self.max_chars, "a format width")

    def _check_str_method(self, owner: str, name: str, args, kwargs) -> None:
        values = [*args, *kwargs.values()]
        if name in SIZED_METHODS:
            _too_long(max([a for a in values if isinstance(a, int)], default=0), self.max_chars, f"str.{name}()")
        elif name == "join" and args and isinstance(args[0], (list, tuple, str)):
            items = args[0]
            _too_long(sum(len(str(i)) for i in items) + len(owner) * max(len(items) - 1, 0), self.max_chars,
                      "a join")
        elif name == "replace" and len(args) >= 2:
            old, new = str(args[0]), str(args[1])
            count = owner.count(old) if old else len(owner) + 1
            _too_long(len(owner) + count * (len(new) - len(old)), self.max_chars, "a replace")

    def _bounded_filter(self, name: str, f):
        skip = 0 if getattr(f, "jinja_pass_arg", None) is None else 1  # a context / environment comes first

        @functools.wraps(f)  # keeps jinja_pass_arg (pass_context / pass_environment)
        def bounded(*args, **kwargs):
            self._step()
            if len(args) > skip:
                value, rest = args[skip], args[skip + 1:]
                if name == "join" and not isinstance(value, (str, list, tuple)):
                    value = list(value)  # sized below, then joined: an iterator is consumed once
                    args = (*args[:skip], value, *rest)
                self._check_filter(name, value, rest, kwargs)
            return f(*args, **kwargs)

        return bounded

    def _check_filter(self, name: str, value, rest: tuple, kwargs: dict) -> None:
        if name == "join" and isinstance(value, (str, list, tuple)):
            self._check_str_method(str(rest[0] if rest else kwargs.get("d", "")), "join", (value,), {})
        elif name == "replace" and isinstance(value, str):
            self._check_str_method(value, "replace", rest, {})
        elif name == "format" and isinstance(value, str):
            self._check_format(value, _PERCENT_WIDTH, rest)
        elif name in ("center", "batch", "slice", "indent"):
            size = next(iter([*rest, *kwargs.values()]), 0)
            size = len(size) if isinstance(size, str) else size if isinstance(size, int) else 0
            lines = value.count("\n") + 1 if name == "indent" and isinstance(value, str) else 1
            _too_long(size * lines, self.max_chars, f"the {name} filter's result")


@contextmanager
def deadline(seconds: float, what: str):
    """Raise RenderTimeout inside the block after `seconds` of wall time (SIGALRM). Not armed outside the main
    thread (signals are delivered there only) or when another SIGALRM timer is running."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return

    def expire(signum, frame):
        raise RenderTimeout(f"{what} took more than limits.render_timeout_s ({seconds:g} s)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

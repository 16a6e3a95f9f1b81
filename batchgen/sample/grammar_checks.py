"""Checks of a response format that xgrammar's parser does not make, run before any model loads (through
grammar.py's `grammar_error`):

  * a JSON Schema nested deeper than MAX_SCHEMA_DEPTH JSON objects/arrays: a deep schema is slow to compile,
    and the job's sampling settings are dumped (fingerprint) by pydantic, which stops at a fixed depth;
  * JSON Schema keywords xgrammar accepts but does not enforce (`not`, `if`/`then`/`else`, `uniqueItems`, ...):
    the completions are generated as if they were absent, so they may break them. Not an error (a schema
    carrying them as documentation is common): run and validate say which, where (`unenforced_keywords`);
  * a format that admits no completion at all: `root ::= root` parses, but its matcher allows no first token,
    so every row would fail at its first step. Asked of a matcher over a byte vocabulary (each of the 256
    bytes one token, plus an end token), where every string is a sequence of tokens: no allowed token and no
    end means the language is empty. A format that dead-ends later (`root ::= "a" x  x ::= x`) is not caught.
"""

from __future__ import annotations

import functools

MAX_SCHEMA_DEPTH = 64  # nested JSON objects and arrays of a json_schema (about 32 levels of properties)
END_TOKEN = 256  # the byte vocabulary's end token id


def json_depth(value) -> int:
    """How deeply JSON objects and arrays nest in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def depth_error(rf) -> str | None:
    if rf.type == "json_schema" and json_depth(rf.json_schema) > MAX_SCHEMA_DEPTH:
        return (f"the schema nests more than {MAX_SCHEMA_DEPTH} JSON objects/arrays deep; flatten it (a $ref to a "
                f"shared definition does not count as nesting)")
    return None


# Keywords xgrammar 0.2.9 parses and leaves out of the grammar (tests/sample/test_grammar_checks.py compiles each
# and checks the grammar is the same without it: an xgrammar that starts enforcing one fails that test).
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "propertyNames",
                       "unevaluatedProperties", "unevaluatedItems", "uniqueItems", "contains", "maxContains")
# (minContains is left out: it makes xgrammar ask for a non-empty array; `contains` beside it is named)
# where subschemas sit: a keyword's name under `properties` / `$defs` is a property or definition name, not a keyword
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
MAX_NAMED = 5  # places named in a message


def _pointer_token(name) -> str:
    """A name as one JSON pointer token (RFC 6901: ~ as ~0, / as ~1)."""
    return str(name).replace("~", "~0").replace("/", "~1")


def unenforced_keywords(schema) -> list[str]:
    """"'<keyword>' at <JSON pointer>" for every UNENFORCED_KEYWORDS keyword of a JSON Schema, in document order
    (without recursion: schemas may nest deeply)."""
    found, stack = [], [(schema, "")]
    while stack:
        node, where = stack.pop()
        children = []
        if isinstance(node, dict):
            for k, v in node.items():
                if k in UNENFORCED_KEYWORDS and not (k in ("then", "else") and "if" in node):
                    found.append(f"{k!r} at {where or '/'}")
                path = f"{where}/{_pointer_token(k)}"
                if k in SCHEMA_MAPS and isinstance(v, dict):  # names -> subschemas
                    children += [(sub, f"{path}/{_pointer_token(n)}") for n, sub in v.items()]
                elif k not in ("enum", "const", "default", "examples"):  # values there are data, not schemas
                    children.append((v, path))
        elif isinstance(node, list):
            children = [(v, f"{where}/{i}") for i, v in enumerate(node)]
        stack.extend(reversed(children))
    return found


def unenforced_warning(rf, subject: str = "sampling.response_format.json_schema") -> str | None:
    """A warning naming the keywords of a json_schema format that xgrammar does not enforce (None: none)."""
    if rf is None or rf.type != "json_schema":
        return None
    found = unenforced_keywords(rf.json_schema)
    if not found:
        return None
    more = f" and {len(found) - MAX_NAMED} more" if len(found) > MAX_NAMED else ""
    return (f"batchgen: warning: {subject} uses keywords xgrammar does not enforce: "
            f"{', '.join(found[:MAX_NAMED])}{more}. Completions are generated as if they were absent and may break "
            f"them; express the constraint with enum, pattern, anyOf or required where it matters")


@functools.cache
def _byte_compiler():
    import xgrammar as xgr

    vocab = [bytes([b]) for b in range(256)] + [b"<end>"]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[END_TOKEN])
    return info, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def empty_language_error(grammar) -> str | None:
    """Why a compiled-to-be xgrammar Grammar admits no completion (None when its first step allows a byte or
    the end)."""
    import xgrammar as xgr

    info, compiler = _byte_compiler()
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    if bool((mask != 0).any()):
        return None
    return ("it admits no completion: no first character is allowed and it cannot end empty (a rule that only "
            "refers to itself, like `root ::= root`, produces nothing); give every rule an alternative that "
            "ends in text")

"""Checks of a response format that xgrammar's parser does not make, run before any model loads (through
grammar.py's `grammar_error`):

  * a JSON Schema nested deeper than MAX_SCHEMA_DEPTH JSON objects/arrays: a deep schema is slow to compile,
    and the job's sampling settings are dumped (fingerprint) by pydantic, which stops at a fixed depth;
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

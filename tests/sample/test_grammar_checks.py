"""JSON Schema keywords xgrammar does not enforce are named, with where they sit, by run and validate; the list is
checked against the pinned xgrammar (each keyword leaves the compiled grammar unchanged)."""

from __future__ import annotations

import json

import pytest

from batchgen.sample.grammar_checks import UNENFORCED_KEYWORDS, unenforced_keywords, unenforced_warning
from batchgen.sampling_params import ResponseFormat

BASE = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                         "c": {"type": "array", "items": {"type": "integer"}}},
        "required": ["a", "b", "c"]}
# each keyword with a value that would constrain BASE's instances (at the root or on its array "c")
CONSTRAINING = {
    "not": ("root", {"type": "object"}), "if": ("root", {"properties": {"a": {"const": 1}}}),
    "then": ("root", {"required": ["d"]}), "else": ("root", {"required": ["d"]}),
    "dependentRequired": ("root", {"a": ["d"]}), "dependentSchemas": ("root", {"a": {"required": ["d"]}}),
    "propertyNames": ("root", {"maxLength": 1}), "unevaluatedProperties": ("root", False),
    "unevaluatedItems": ("c", False), "uniqueItems": ("c", True), "contains": ("c", {"const": 3}),
    "maxContains": ("c", 1),
}


def _grammar(schema) -> str:
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))


@pytest.mark.parametrize("keyword", UNENFORCED_KEYWORDS)
def test_each_listed_keyword_leaves_the_pinned_xgrammars_grammar_unchanged(keyword):
    where, value = CONSTRAINING[keyword]
    schema = json.loads(json.dumps(BASE))
    (schema if where == "root" else schema["properties"]["c"])[keyword] = value
    assert _grammar(schema) == _grammar(BASE)


def test_an_enforced_keyword_changes_the_grammar_so_the_check_above_can_fail():
    schema = json.loads(json.dumps(BASE))
    schema["properties"]["c"]["minItems"] = 2
    assert _grammar(schema) != _grammar(BASE)


def test_unenforced_keywords_are_found_with_their_json_pointer_and_names_are_not_keywords():
    schema = {
        "type": "object",
        "properties": {"not": {"type": "string"},  # a property called "not": a name
                       "tags": {"type": "array", "uniqueItems": True, "items": {"enum": [{"not": 1}]}},
                       "a/b": {"not": {"const": 0}}},
        "$defs": {"if": {"if": {"type": "string"}, "then": {"minLength": 2}}},
        "anyOf": [{"contains": {"const": 1}}],
        "examples": [{"uniqueItems": 1}],
    }
    assert unenforced_keywords(schema) == ["'uniqueItems' at /properties/tags", "'not' at /properties/a~1b",
                                           "'if' at /$defs/if", "'contains' at /anyOf/0"]
    assert unenforced_keywords(BASE) == []


def test_the_warning_names_the_key_and_at_most_five_places():
    rf = ResponseFormat(type="json_schema", json_schema={"anyOf": [{"not": {}} for _ in range(7)]})
    warning = unenforced_warning(rf)
    assert warning.startswith("batchgen: warning: sampling.response_format.json_schema uses keywords xgrammar does "
                              "not enforce: 'not' at /anyOf/0")
    assert "'not' at /anyOf/4 and 2 more." in warning and "/anyOf/5" not in warning
    assert unenforced_warning(ResponseFormat(type="json_schema", json_schema=BASE)) is None
    assert unenforced_warning(ResponseFormat(type="regex", regex="a+")) is None

"""SamplingParams: what to generate for one prompt. Plain, validated, immutable.

The one definition of the sampling settings: the job file's `sampling:` section is this model, so a new
setting is a field here (plus its use in `sample/`), and the job file, `--set` and the Python API all get it.
"""

from __future__ import annotations

import json
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PositiveInt = Annotated[int, Field(gt=0)]
# No model's context holds more tokens; the model's own context (EngineConfig.max_model_len or the config's
# max_position_embeddings) bounds it further, checked where the config is read (the engine, validate, run).
MAX_NEW_TOKENS = 1 << 24
MAX_LOGPROBS = 20  # top log-probs per position (vLLM's and OpenAI's limit)
# A temperature other than 0 within these bounds: the sampler divides float32 logits by it, and beyond them the
# quotients overflow (1e-40 made every positive logit +inf: ties drawn as token 0; 1e39 or .inf: NaN logits that
# broke response_format, min_new_tokens and top_k). Below MIN_TEMPERATURE a draw is greedy anyway; above
# MAX_TEMPERATURE it is uniform over the allowed tokens.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 1e5
MAX_REPETITION_PENALTY = 1e5  # positive logits divided, negative multiplied by it: float32 overflows beyond


def _members(tp) -> list:
    """A type's alternatives, Annotated metadata and Optional/Union unwrapped."""
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, UnionType):
        return [m for a in get_args(tp) for m in _members(a)]
    return [tp]


def _bool_in_a_number(value: Any, tp) -> bool:
    """Whether `value` holds true/false where `tp` wants a number (pydantic's lax mode reads true as 1)."""
    members = _members(tp)
    if isinstance(value, bool):
        takes_bool = any(m is bool or m is Any or (get_origin(m) is Literal and any(isinstance(a, bool)
                                                                                       for a in get_args(m)))
                         for m in members)
        return not takes_bool and any(isinstance(m, type) and issubclass(m, (int, float)) for m in members)
    for m in members:
        origin, args = get_origin(m), get_args(m)
        if origin in (list, tuple) and isinstance(value, (list, tuple)) and args:
            kinds = args[:1] * len(value) if origin is list or args[-1] is Ellipsis else args
            if any(_bool_in_a_number(v, k) for v, k in zip(value, kinds)):
                return True
    return False


class NoBooleanNumbers(BaseModel):
    """A config model whose number fields refuse true/false (lax pydantic reads `temperature: true` as 1.0 and
    `stop_token_ids: [true]` as [1]: a typo that silently means 1)."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value, info):
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, (bool, list, tuple)) and _bool_in_a_number(value, annotation):
            raise ValueError(f"{info.field_name} takes a number, not true or false")
        return value


# structured output
class ResponseFormat(NoBooleanNumbers):
    """What every completion must be: a JSON object, a JSON Schema's instance, a regex's match, one of the
    choices, or a sentence of an EBNF grammar (xgrammar's dialect). Only the field of its `type` is set.
    Checked here for shape only; whether xgrammar accepts the schema / regex / grammar is checked by
    sample/grammar.py `check_response_format` (the job does it before the model loads)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["json_object", "json_schema", "regex", "choice", "grammar"] = Field(description=(
        "json_object (any JSON object), json_schema (an instance of json_schema), regex (a full match of regex), "
        "choice (exactly one of choices) or grammar (a sentence of an EBNF grammar)."))
    json_schema: dict[str, Any] | None = Field(None, description=(
        "type json_schema: the JSON Schema itself (an object)."))
    regex: str | None = Field(None, description="type regex: the regular expression the whole completion matches.")
    choices: tuple[str, ...] | None = Field(None, description=(
        "type choice: the strings the completion may be (exactly one of them)."))
    grammar: str | None = Field(None, description=(
        "type grammar: an EBNF grammar with a `root` rule (xgrammar's dialect)."))

    @model_validator(mode="after")
    def _its_field_only(self) -> ResponseFormat:
        own = {"json_object": None, "json_schema": "json_schema", "regex": "regex", "choice": "choices",
               "grammar": "grammar"}[self.type]
        others = [f for f in ("json_schema", "regex", "choices", "grammar")
                  if f != own and getattr(self, f) is not None]
        if others:
            raise ValueError(f"type {self.type} takes {own or 'no other field'}, not {', '.join(others)}")
        if own is not None and not getattr(self, own):
            raise ValueError(f"type {self.type} needs a non-empty {own}")
        if self.choices is not None and any(c == "" for c in self.choices):
            raise ValueError("choices must be non-empty strings")
        return self

    def source(self) -> tuple[str, str]:
        """(kind, text) for the grammar compiler: kind json_schema | regex | grammar; equal formats give equal
        pairs (the compiled-grammar cache's key). A choice is an EBNF alternation of JSON-quoted literals."""
        if self.type == "json_object":
            return "json_schema", '{"type": "object"}'
        if self.type == "json_schema":
            return "json_schema", json.dumps(self.json_schema)  # key order kept: properties come out in it
        if self.type == "choice":
            return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices)
        return self.type, self.regex if self.type == "regex" else self.grammar


class SamplingParams(NoBooleanNumbers):
    """Decoding settings of one prompt (and its `n` samples).

    temperature == 0 means greedy. top_k == 0, top_p == 1.0 and min_p == 0.0 disable those filters.
    Seeds: sample 0 of a prompt uses `seed` itself and sample i > 0 `derive_seed(seed, i)` (the job runner
    passes its own per-row seeds instead); the noise of each draw is a function of that seed and the token
    position only, so the tokens a sample gets do not depend on what else is in the batch or on arrival order.
    Invalid values raise pydantic's ValidationError, a ValueError that names the field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: Annotated[int, Field(ge=0)] = Field(256, description=(
        "Tokens to generate at most per completion (the model's context bounds it too). 0 scores the prompt "
        "only (needs prompt_logprobs: true)."))
    min_new_tokens: Annotated[int, Field(ge=0)] = Field(0, description=(
        "EOS and stop_token_ids cannot end a completion before this many tokens."))
    temperature: Annotated[float, Field(ge=0)] = Field(0.7, description=(
        "Softmax temperature: 0 is greedy, else between 1e-5 and 1e5 (the float32 logits divided by it stay in "
        "range)."))
    top_p: Annotated[float, Field(gt=0, le=1)] = Field(1.0, description=(
        "Nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p; 1.0 turns it "
        "off."))
    top_k: Annotated[int, Field(ge=0)] = Field(0, description=(
        "Draw from the k most likely tokens only; 0 turns it off."))
    min_p: Annotated[float, Field(ge=0, lt=1)] = Field(0.0, description=(
        "Drop tokens whose probability is below min_p times the most likely token's; 0.0 turns it off."))
    repetition_penalty: Annotated[float, Field(gt=0)] = Field(1.0, description=(
        "Divide positive logits (multiply negative ones) of tokens already in the prompt or the completion by "
        "this value (transformers' and vLLM's definition), between 1e-5 and 1e5; 1.0 turns it off."))
    # OpenAI's penalties, as vLLM applies them
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = Field(0.0, description=(
        "Subtract this once from the logit of every token the completion already holds (OpenAI's definition; "
        "prompt tokens do not count); 0 turns it off."))
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = Field(0.0, description=(
        "Subtract this times the token's count in the completion from its logit (OpenAI's definition; prompt "
        "tokens do not count); 0 turns it off."))
    # kept as (id, bias) pairs sorted by id, so the model stays immutable and hashable
    logit_bias: tuple[tuple[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100, le=100)]], ...] = Field(
        (), description="{token id: bias}: added to that token's logit at every step.")
    stop: tuple[str, ...] = Field((), description=(
        "Stop strings: a completion ends before the first one it produces (not part of its text). One string "
        "is one stop string."))
    stop_token_ids: tuple[int, ...] = Field((), description=(
        "Token ids that end a completion, besides EOS. The id that ended a completion is not part of its text."))
    n: PositiveInt = Field(1, description="Completions per prompt (they share the prompt's K/V cache blocks).")
    seed: int = Field(0, description=(
        "The job's seed. Each sample's seed derives from (seed, row key, sample index), so a resumed or "
        "re-sharded run samples every row as an uninterrupted one."))
    ignore_eos: bool = Field(False, description=(
        "Keep generating past EOS until max_new_tokens (benchmarks, length-controlled data)."))
    # log-probs are the model's own: log_softmax of the raw fp32 logits, before penalties, temperature, filters
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(None, description=(
        "K: store each generated token's log-prob and the top K alternatives (0: the sampled token's alone); "
        "null: none. The model's own log-probs, before penalties, temperature and filters."))
    prompt_logprobs: bool = Field(False, description=(
        "Also store one log-prob per prompt token (the first is null): the prompt scored by the model."))
    thinking_budget: Annotated[int, Field(ge=0)] | None = Field(None, description=(
        "Reasoning models: after this many tokens inside the think block, its end marker is forced next; "
        "null: no budget."))
    response_format: ResponseFormat | None = Field(None, description=(
        "Constrain every completion to a format (JSON, a JSON Schema, a regex, a choice, a grammar); null: "
        "free text."))

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new_tokens_fits_a_context(cls, value: int) -> int:
        if value > MAX_NEW_TOKENS:
            raise ValueError(f"more than {MAX_NEW_TOKENS}, more tokens than any model's context holds; the "
                             f"model's context (engine.max_model_len or its max_position_embeddings) bounds it "
                             f"further, minus the prompt's tokens")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_string_is_one_stop(cls, value):
        return (value,) if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature_in_float_range(cls, value: float) -> float:
        if value != 0 and not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
            raise ValueError(f"{value} is neither 0 (greedy) nor between {MIN_TEMPERATURE:g} and "
                             f"{MAX_TEMPERATURE:g}: the logits divided by it leave float32's range")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty_in_float_range(cls, value: float) -> float:
        if not 1 / MAX_REPETITION_PENALTY <= value <= MAX_REPETITION_PENALTY:
            raise ValueError(f"{value} is not between {1 / MAX_REPETITION_PENALTY:g} and {MAX_REPETITION_PENALTY:g} "
                             f"(1.0 turns it off): the logits divided or multiplied by it leave float32's range")
        return value

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_is_a_count(cls, value):
        if isinstance(value, bool):  # `logprobs: true` would silently mean K = 1
            raise ValueError(f"logprobs takes K, the number of top log-probs per token (0..{MAX_LOGPROBS}): 0 "
                             f"gives the sampled token's log-prob alone; null turns them off (got {value})")
        return value

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")
        if self.max_new_tokens == 0 and not self.prompt_logprobs:
            raise ValueError("max_new_tokens: 0 generates nothing; it is allowed only to score prompts, with "
                             "prompt_logprobs: true")
        # structured output: the grammar decides every token, also where the completion ends
        if self.response_format is not None and (self.min_new_tokens or self.thinking_budget is not None):
            raise ValueError("response_format decides where a completion ends and which token comes next: it "
                             "cannot be combined with min_new_tokens > 0 or thinking_budget")
        return self

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_from_a_mapping(cls, value):
        if not isinstance(value, dict):
            return value
        pairs = []
        for key, bias in value.items():
            try:  # JSON keys are strings; a bool or a fraction is no token id (int() would take 1 or 1.5 as 1)
                if isinstance(key, bool) or (isinstance(key, float) and not key.is_integer()):
                    raise ValueError
                token = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys are token ids, got {key!r}") from None
            if token < 0:
                raise ValueError(f"logit_bias keys are token ids (>= 0), got {token}")
            pairs.append((token, bias))
        return tuple(sorted(pairs))

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_are_token_ids(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(t < 0 for t in value):
            raise ValueError(f"stop_token_ids are token ids (>= 0), got {[t for t in value if t < 0][:5]}")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids the model does not have (ValueError naming the field)."""
        bias_ids = [t for t, _ in self.logit_bias]
        bad = sorted(t for t in (*bias_ids, *self.stop_token_ids) if t >= vocab_size)
        if bad:
            field = "logit_bias" if any(t in bias_ids for t in bad) else "stop_token_ids"
            raise ValueError(f"{field}: token ids {bad[:5]} are outside the model's vocabulary of {vocab_size} tokens")

    @property
    def uses_penalty_table(self) -> bool:
        """Whether a running sequence needs a row of the runner's table of the tokens it has seen."""
        return needs_penalty_table(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)


def needs_penalty_table(repetition_penalty: float, presence_penalty: float, frequency_penalty: float) -> bool:
    """Whether these penalties read the tokens a sequence has seen (PenaltyTable, sample/penalty.py)."""
    return repetition_penalty != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0

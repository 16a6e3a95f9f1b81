"""The feature matrices' shared draws (tests/sample/test_feature_matrix.py, tests/job/test_feature_matrix_jobs.py):
the matrix seed, the response formats with a check of each format's completions, and a row's random `sampling:`."""

from __future__ import annotations

import json
import os
import random
import re

import jsonschema

MATRIX_SEED = int(os.environ.get("MATRIX_SEED", "0"))

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["word", "count", "ok"]}
REGEX = "(fox|dog|sea)( (fox|dog|sea)){0,2} [0-9]{1,3}"
CHOICES = ("yes", "no", "maybe so")
GRAMMAR = 'root ::= ("red" | "blue") " " [0-9] [0-9]?'
GRAMMAR_AS_REGEX = "(red|blue) [0-9][0-9]?"
FORMATS = {
    "json_schema": ({"type": "json_schema", "json_schema": SCHEMA},
                    lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    "json_object": ({"type": "json_object"}, lambda text: isinstance(json.loads(text), dict)),
    "regex": ({"type": "regex", "regex": REGEX}, lambda text: re.fullmatch(REGEX, text) is not None),
    "choice": ({"type": "choice", "choices": list(CHOICES)}, lambda text: text in CHOICES),
    "grammar": ({"type": "grammar", "grammar": GRAMMAR}, lambda text: re.fullmatch(GRAMMAR_AS_REGEX, text) is not None),
}
STOPS = ["e", "th", "sea", " ", "!!", "ab"]


def random_sampling(rng: random.Random, vocab_size: int) -> dict:
    s: dict = {"seed": rng.randrange(1 << 31), "max_new_tokens": rng.choice([0, 1, 2, 5, 16, 33, 64])}
    s["temperature"] = 0.0 if rng.random() < 0.25 else round(rng.uniform(0.3, 1.5), 2)
    if rng.random() < 0.4:
        s["top_k"] = rng.choice([1, 2, 5, 40, 1000])
    if rng.random() < 0.4:
        s["top_p"] = rng.choice([0.05, 0.5, 0.9, 0.99])
    if rng.random() < 0.3:
        s["min_p"] = rng.choice([0.01, 0.1, 0.5])
    if rng.random() < 0.3:
        s["repetition_penalty"] = rng.choice([0.8, 1.1, 1.5])
    if rng.random() < 0.25:
        s["presence_penalty"] = rng.choice([-1.0, 0.5, 2.0])
    if rng.random() < 0.25:
        s["frequency_penalty"] = rng.choice([-0.5, 0.3, 1.5])
    if rng.random() < 0.25:
        s["logit_bias"] = {str(rng.randrange(vocab_size)): rng.choice([-100.0, -5.0, 5.0, 100.0])
                           for _ in range(rng.randint(1, 3))}
    if rng.random() < 0.5:
        s["n"] = rng.randint(1, 4)
    if rng.random() < 0.3:
        s["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.2:
        s["stop_token_ids"] = [rng.randrange(5, vocab_size) for _ in range(rng.randint(1, 2))]
    if rng.random() < 0.2:
        s["min_new_tokens"] = rng.choice([1, 4, 20])
    if rng.random() < 0.1:
        s["ignore_eos"] = True
    if rng.random() < 0.4:
        s["logprobs"] = rng.choice([0, 1, 5])
    if rng.random() < 0.2 or s["max_new_tokens"] == 0:
        s["prompt_logprobs"] = True
    if rng.random() < 0.35:
        s["response_format"] = FORMATS[rng.choice(sorted(FORMATS))][0]
    if rng.random() < 0.15:
        s["thinking_budget"] = rng.choice([0, 3, 10])
    return s

"""Structured output: grammars compiled by xgrammar, one matcher per running sequence, and the token
bitmask that constrains its next token.

Pieces, host to device:
  * `check_response_format`: whether xgrammar accepts a ResponseFormat's schema / regex / grammar, without a
    tokenizer (the job runs it before the model loads); ValueError naming the key and xgrammar's reason.
  * `GrammarCache`: the GrammarCompiler over the engine's tokenizer (TokenizerInfo, the model's vocabulary
    size), each distinct (kind, text) compiled once and kept (LRU, MAX_COMPILED).
  * `GrammarState`: one sequence's GrammarMatcher, advanced on the host with every token appended to it
    (Request.append_token), in order; its state is always "every output token accepted".
  * `fill_bitmasks`: the next-token bitmasks of a step's constrained rows, int32 [G, ceil(V / 32)]: bit t % 32
    of word t // 32 set = token t allowed (xgrammar's layout).
  * `apply_token_bitmask`: masked logits = -inf, on the logits' device, out of place (the raw logits stay for
    the log-probs, sample/logprobs.py); the sampler does it before penalties, temperature and filters.

The async pipeline (engine.step). A constrained row's mask for step N+1 depends on token N, which the host
learns only after it has dispatched N+1. Design: step N+1's forward is dispatched as usual (its input token N
is carried over on the device); only its sampling is held back (ModelRunner.dispatch returns it deferred).
The engine then collects step N, appends its tokens (each matcher accepts its row's token), fills N+1's
bitmasks and queues the masked sampling of N+1 (ModelRunner.sample_deferred) before it schedules N+2. Every
row still runs every step; what it costs is the host's matcher and mask work per step, which on CUDA
overlaps step N+1's forward. Without the async pipeline the masks are filled before the step runs.
Invariant: a mask is filled from a matcher that has accepted every token of its row but the one the step
samples. A row that finished at step N (stop token, length) may still be in N+1: its mask is all ones
(whatever it draws is dropped).

Ends: a matcher's stop tokens are the row's own (EOS unless ignore_eos, and stop_token_ids); they are allowed
only where the grammar may end. A matcher without stop tokens terminates as soon as the grammar is complete.
Either way Request.append_token finishes a row whose matcher terminated with finish_reason "stop".
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from batchgen.sample.grammar_mask import apply_token_bitmask, bitmask_words

__all__ = ["GrammarCache", "GrammarState", "apply_token_bitmask", "bitmask_words", "check_response_format",
           "fill_bitmasks", "grammar_error"]

MAX_COMPILED = 1024  # distinct compiled grammars kept (a per-row schema column may have many)
BATCH_FILL_MIN_ROWS = 16  # from this many rows, masks are filled by xgrammar's thread pool
# JSON layout: xgrammar's compact separators (", ", ": "), no free whitespace: a small model left free to emit
# whitespace between tokens can emit it forever (observed with SmolLM2: newlines until max_new_tokens)
JSON_ANY_WHITESPACE = False
FIELD_OF = {"json_schema": "json_schema", "regex": "regex", "grammar": "grammar", "json_object": None,
            "choice": "choices"}


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ location prefix ("[08:35:16] /project/cpp/x.cc:94: ")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"^\[[\d:]+\] \S+?:\d+: ", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)


def _grammar(kind: str, text: str):
    import xgrammar as xgr

    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(text, any_whitespace=JSON_ANY_WHITESPACE)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    return xgr.Grammar.from_ebnf(text)


def grammar_error(rf) -> str | None:
    """xgrammar's reason for refusing a ResponseFormat's schema / regex / grammar, or None when it is usable.
    Also refused: a schema nested too deeply, a format that admits no completion (sample/grammar_checks.py)."""
    from batchgen.sample.grammar_checks import depth_error, empty_language_error

    reason = depth_error(rf)
    if reason is not None:
        return reason
    try:
        grammar = _grammar(*rf.source())
    except RecursionError:
        return "the format nests too deeply to parse; flatten it"
    except Exception as e:  # xgrammar raises RuntimeError (and InvalidJSONError) with its reason
        return _reason(e)
    return empty_language_error(grammar)


def check_response_format(rf, key: str = "sampling.response_format") -> None:
    """ValueError('<key>.<field>: xgrammar cannot use it: <reason>') when xgrammar refuses the format."""
    reason = grammar_error(rf)
    if reason is not None:
        field = FIELD_OF[rf.type]
        raise ValueError(f"{key}{'.' + field if field else ''}: xgrammar cannot use it: {reason}")


class GrammarState:
    """One sequence's matcher. Not thread-safe; advanced only by its Request, read by `fill_bitmasks`.

    `stop_token_ids` (the row's own, beside EOS) end the row, and only where the grammar may end: xgrammar would
    also take such a token as text where the grammar allows its characters, so `fill_bitmasks` clears their bits
    until the matcher is complete. `dead_end`: the latest mask allowed no token (a format whose every next token
    is one of those stop ids): the row cannot go on."""

    def __init__(self, matcher, stop_token_ids: Sequence[int] = ()) -> None:
        self.matcher = matcher
        self.stop_token_ids = tuple(stop_token_ids)
        self.dead_end = False

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it here."""
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarCache:
    """Compiles response formats for one tokenizer and vocabulary; hands out a fresh state per sequence."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int], max_threads: int = 8) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size  # the model's (logits' width), which may exceed the tokenizer's
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(eos_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.num_compiled = 0  # compilations so far (cache misses)

    def compiled(self, rf):
        """The CompiledGrammar of a ResponseFormat, compiled on first use; ValueError naming the field."""
        source = rf.source()
        hit = self._compiled.get(source)
        if hit is not None:
            self._compiled.move_to_end(source)
            return hit
        check_response_format(rf)  # the clear message; compile_* would fail alike
        kind, text = source
        if kind == "json_schema":
            compiled = self.compiler.compile_json_schema(text, any_whitespace=JSON_ANY_WHITESPACE)
        elif kind == "regex":
            compiled = self.compiler.compile_regex(text)
        else:
            compiled = self.compiler.compile_grammar(text)
        self.num_compiled += 1
        self._compiled[source] = compiled
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return compiled

    def state(self, rf, stop_token_ids: Sequence[int], text_stop_token_ids: Sequence[int] = ()) -> GrammarState:
        """A matcher at the start of `rf`; `stop_token_ids` end the row where the grammar may end (empty: the
        matcher terminates once the grammar is complete); `text_stop_token_ids`, those of them that are not
        special tokens, are masked out until then (GrammarState says why)."""
        stops = sorted(set(stop_token_ids))
        matcher = self._xgr.GrammarMatcher(self.compiled(rf), override_stop_tokens=stops or None,
                                           terminate_without_stop_token=not stops)
        return GrammarState(matcher, text_stop_token_ids)

    def fill(self, states: Sequence[GrammarState], out: torch.Tensor) -> None:
        fill_bitmasks(states, out, self._xgr)


_BATCH_MATCHER = None  # xgrammar's thread pool, made on first large fill


def fill_bitmasks(states: Sequence[GrammarState], out: torch.Tensor, xgr=None) -> None:
    """out [>= G, W] int32 on the CPU: row i = the next-token bitmask of states[i]; all ones for a terminated
    matcher (its row finished; the token it draws is dropped). Sets each live state's `dead_end`."""
    global _BATCH_MATCHER
    live = [i for i, s in enumerate(states) if not s.terminated]
    if len(live) < len(states):
        out[[i for i, s in enumerate(states) if s.terminated]] = -1
    if len(live) >= BATCH_FILL_MIN_ROWS:
        if _BATCH_MATCHER is None:
            import xgrammar

            _BATCH_MATCHER = (xgr or xgrammar).BatchGrammarMatcher("auto")
        _BATCH_MATCHER.batch_fill_next_token_bitmask([states[i].matcher for i in live], out, indices=live)
    else:
        for i in live:
            states[i].matcher.fill_next_token_bitmask(out, i)
    words = None
    for i in live:
        s = states[i]
        if s.stop_token_ids and not s.matcher.is_completed():  # a stop id is never text: not yet allowed
            words = out.numpy().view(np.uint32) if words is None else words
            for t in s.stop_token_ids:
                words[i, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    if live:
        dead = (out[live] == 0).all(dim=1).tolist()
        for i, d in zip(live, dead):
            states[i].dead_end = d


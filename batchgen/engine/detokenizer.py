"""Incremental detokenization for stop strings, and the final text of a sample."""

from __future__ import annotations


class StopStringWatcher:
    """Decodes generated tokens incrementally (O(1) tokens per step) and reports a stop string.

    Two offsets bracket the tokens decoded last step, so multi-byte characters split across tokens and
    tokenizers that change a token's text by its left neighbour decode as they would in one piece.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max(len(s) for s in stop)
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def hit(self, output_token_ids: list[int]) -> bool:
        prefix_text = self._decode(output_token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(output_token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False  # an incomplete character: wait for the next token
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(output_token_ids)
        return any(s in self.text[search_from:] for s in self.stop)


def text_token_ids(token_ids: list[int], finish_reason: str, stop_token_ids: tuple[int, ...]) -> list[int]:
    """The ids a completion's text is made of: all but a stop token id that ended it. What stopped a completion
    is never its text: EOS (a special token), stop strings (cut) and stop token ids alike; `token_ids` keep it."""
    if finish_reason == "stop" and token_ids and token_ids[-1] in stop_token_ids:
        return token_ids[:-1]
    return token_ids


def final_text(tokenizer, token_ids: list[int], stop: tuple[str, ...], cut_at_stop: bool) -> str:
    """The sample's text without special tokens; cut before the first stop string when one ended it."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    if cut_at_stop:
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
        text = text[:cut]
    return text

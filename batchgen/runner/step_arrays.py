"""StepArrays: a ScheduledBatch's index math on the host (numpy), the same for every forward path.

Packing order: sequences with one new token (decodes) first, then the others (prefill chunks), each group
in batch order. A mixed step then splits cleanly: its first `num_decode_seqs` sequences are one token each
and run the decode kernel; the rest run the prefill attention, with no padding of the decodes to the
longest chunk. Sampled tokens still come out in batch order: `last_index` maps each sequence of the batch
to the packed position of its last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.engine.batch import ScheduledBatch


@dataclass
class StepArrays:
    """S = sequences, T = packed tokens, W = longest block table. Rows of per-sequence arrays are in packed
    order (decodes first); `last_index` is in batch order."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: cache slot of each token's K/V
    q_lens: np.ndarray  # [S] int64
    seq_lens: np.ndarray  # [S] int64: tokens in the cache after the step
    query_start_loc: np.ndarray  # [S + 1] int64
    block_tables: np.ndarray  # [S, W] int32
    last_index: np.ndarray  # [S] int64, batch order: packed index of each sequence's last token
    num_decode_seqs: int  # the leading sequences with exactly one new token

    @classmethod
    def build(cls, batch: ScheduledBatch, block_size: int) -> StepArrays:
        one = [i for i, s in enumerate(batch.seqs) if s.num_new_tokens == 1]
        if len(one) in (0, len(batch.seqs)) or one[-1] == len(one) - 1:
            order = None  # already packed decodes-first
            seqs = batch.seqs
        else:
            chosen = set(one)
            order = one + [i for i in range(len(batch.seqs)) if i not in chosen]
            seqs = [batch.seqs[i] for i in order]
        n = len(seqs)
        q_lens = np.fromiter((s.num_new_tokens for s in seqs), dtype=np.int64, count=n)
        seq_lens = np.fromiter((s.seq_len for s in seqs), dtype=np.int64, count=n)
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        table_lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=n)
        block_tables = np.zeros((n, int(table_lens.max())), dtype=np.int32)
        # one vectorised fill (row-major order of the mask == the tables concatenated); the scheduler's tables
        # are int32 arrays already, so this copies memory, not Python ints
        block_tables[np.arange(block_tables.shape[1]) < table_lens[:, None]] = np.concatenate(
            [np.asarray(s.block_table, dtype=np.int32) for s in seqs])
        input_ids = np.fromiter((t for s in seqs for t in s.input_token_ids), dtype=np.int64,
                                count=int(query_start_loc[-1]))
        # positions: start_pos .. seq_len - 1 of each sequence, packed
        seq_of_token = np.repeat(np.arange(n), q_lens)
        positions = np.arange(len(input_ids)) - query_start_loc[:-1][seq_of_token] + (seq_lens - q_lens)[seq_of_token]
        slot_mapping = block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + \
            positions % block_size
        last_packed = query_start_loc[1:] - 1
        if order is None:
            last_index = last_packed
        else:
            last_index = np.empty(n, dtype=np.int64)
            last_index[np.asarray(order)] = last_packed
        return cls(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, q_lens=q_lens,
                   seq_lens=seq_lens, query_start_loc=query_start_loc, block_tables=block_tables,
                   last_index=last_index, num_decode_seqs=len(one))

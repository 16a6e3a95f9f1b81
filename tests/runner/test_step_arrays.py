"""StepArrays: packing a batch decodes-first, with sampled rows mapped back to batch order."""

from __future__ import annotations

import numpy as np

from batchgen.engine.batch import ScheduledBatch, SeqSchedule


def _seq(rid, tokens, start, table, sample):
    return SeqSchedule(request_id=rid, input_token_ids=tuple(tokens), start_pos=start, block_table=tuple(table),
                       sampling=object() if sample else None)


def test_mixed_batch_is_packed_decodes_first_and_last_index_follows_batch_order():
    from batchgen.runner.step_arrays import StepArrays

    batch = ScheduledBatch(seqs=[
        _seq("chunk0", [10, 11, 12], 0, [7], sample=False),  # first chunk of a prompt
        _seq("dec1", [20], 5, [8, 3], sample=True),
        _seq("chunk2", [30, 31], 4, [1, 2], sample=True),  # last chunk: samples
        _seq("dec3", [40], 9, [4, 5, 6], sample=True),
    ])
    a = StepArrays.build(batch, block_size=4)
    assert a.num_decode_seqs == 2
    assert a.input_ids.tolist() == [20, 40, 10, 11, 12, 30, 31]
    assert a.positions.tolist() == [5, 9, 0, 1, 2, 4, 5]
    assert a.seq_lens.tolist() == [6, 10, 3, 6]
    assert a.slot_mapping.tolist() == [3 * 4 + 1, 6 * 4 + 1, 28, 29, 30, 2 * 4 + 0, 2 * 4 + 1]
    # batch order: chunk0 ends at packed 4, dec1 at 0, chunk2 at 6, dec3 at 1
    assert a.last_index.tolist() == [4, 0, 6, 1]
    assert np.array_equal(a.query_start_loc, [0, 1, 2, 5, 7])


def test_batch_already_decodes_first_keeps_its_order():
    from batchgen.runner.step_arrays import StepArrays

    batch = ScheduledBatch(seqs=[_seq("a", [1], 3, [0], True), _seq("b", [2, 3], 0, [1], True)])
    a = StepArrays.build(batch, block_size=4)
    assert a.input_ids.tolist() == [1, 2, 3] and a.last_index.tolist() == [0, 2] and a.num_decode_seqs == 1

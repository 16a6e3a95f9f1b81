"""Decode graphs to 1,024 sequences: which bucket a step replays (CPU: the bookkeeping), and on a GPU an auto
engine capturing to 1,024 and replaying a step of ~1,000 rows with the eager path's tokens."""

from __future__ import annotations

import pytest
import torch

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.attention.kv_cache import KVCache, KVGeometry
from batchgen.engine.sizing import graph_buckets
from batchgen.runner.cuda_graphs import DecodeGraphs
from conftest import make_model, random_prompts


def test_a_step_replays_the_smallest_bucket_that_holds_it_up_to_1024_rows():
    cache = KVCache(KVGeometry(2, 4, 2, 16), num_blocks=8, block_size=16, dtype=torch.float32,
                    device=torch.device("cpu"))
    graphs = DecodeGraphs(None, None, cache, max_batch=1024, max_model_len=256)
    assert graphs.buckets == graph_buckets(1024)
    assert [graphs.bucket_for(n) for n in (1, 3, 9, 500, 512, 513, 1000, 1024)] == \
        [1, 4, 16, 512, 512, 544, 1024, 1024]
    assert graphs.bucket_for(1025) is None  # more rows than the largest graph: the step runs eagerly
    # static inputs hold the largest bucket; padding rows write to the trash slot
    assert graphs.input_ids.shape == (1024,) and graphs.block_tables.shape == (1024, 16)
    assert bool((graphs.slot_mapping == cache.trash_slot).all())


@pytest.mark.gpu
def test_an_auto_gpu_engine_graphs_to_1024_and_a_1000_row_step_gives_the_eager_tokens():
    model = make_model("llama").cuda()
    prompts = random_prompts([5 + i % 23 for i in range(1000)], seed=3)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    with Engine(model, None, EngineConfig(gpu_memory_utilization=0.3)) as engine:
        graphs = engine.runner.graphs
        assert engine.capacity.max_num_seqs == 1024 and graphs.max_batch == 1024
        assert sorted(graphs._graphs) == graph_buckets(1024)
        graphed = [r.samples[0].token_ids for r in engine.generate(prompts, params)]
        assert engine.max_num_seqs == 1024 and engine.max_num_batched_tokens == 16384
    with Engine(model, None, EngineConfig(gpu_memory_utilization=0.3, cuda_graphs=False)) as engine:
        eager = [r.samples[0].token_ids for r in engine.generate(prompts, params)]
    # fp32, the same kernels; the GEMMs at 1,024 padded rows may round otherwise than at 1,000
    same = sum(g == e for g, e in zip(graphed, eager))
    assert same >= 990, f"{1000 - same} of 1000 sequences differ between graphed and eager decode steps"

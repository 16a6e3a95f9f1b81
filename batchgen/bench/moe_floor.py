"""The bandwidth floor of a Mixture-of-Experts model: the bytes a step must read are the weights every token
reads (attention, norms, routers, dense and shared MLPs, the LM head; not the embedding, whose rows are gathered)
plus each distinct expert the step's tokens are routed to, once (a grouped GEMM reads an expert's weights once
however many of the step's tokens chose it). How many distinct experts a step reads depends on the routing, so
the floor is measured: `RouteRecorder` counts the router's choices per step during a run (on the device, in stream
order, no host sync), `routed_step_bytes` turns them into bytes, `routed_floor_seconds` into seconds.

Geometry from a transformers config: Qwen3-MoE / Qwen2-MoE (num_experts, moe_intermediate_size; dense layers by
mlp_only_layers / decoder_sparse_step; Qwen2-MoE's shared expert) or Mixtral (num_local_experts,
intermediate_size), bf16 weights unless `dtype_bytes` says otherwise; `projection_bytes` (1: FP8 checkpoints) for
the projections (q/k/v/o, dense and shared MLPs, the experts) where they differ from the rest (LM head, norms,
routers).
"""

from __future__ import annotations

import contextlib

import torch


def _experts(cfg) -> tuple[int, int]:
    """(E experts, I the expert's intermediate size)."""
    if cfg.model_type == "mixtral":  # (Qwen configs map num_local_experts to num_experts: not a test)
        return cfg.num_local_experts, cfg.intermediate_size
    return cfg.num_experts, cfg.moe_intermediate_size


def sparse_layers(cfg) -> list[bool]:
    """Which layers have a sparse block, by transformers' rule (the others have a dense MLP)."""
    only_dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return [i not in only_dense and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)]


def expert_bytes(cfg, dtype_bytes: int = 2) -> int:
    """One expert's weights: gate, up and down, H x I each, at `dtype_bytes` a weight."""
    _, inter = _experts(cfg)
    return 3 * cfg.hidden_size * inter * dtype_bytes


def dense_step_bytes(cfg, dtype_bytes: int = 2, projection_bytes: int | None = None) -> int:
    """The weights every step reads whatever the routing: all but the routed experts and the embedding; the
    projections at `projection_bytes` (default dtype_bytes) a weight."""
    proj = projection_bytes or dtype_bytes
    hidden, num_experts = cfg.hidden_size, _experts(cfg)[0]
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    biases = q + 2 * kv if getattr(cfg, "qkv_bias", False) or getattr(cfg, "attention_bias", False) else 0
    qk_norm = 2 * head_dim if cfg.model_type == "qwen3_moe" else 0
    projections, rest = 0, hidden + cfg.vocab_size * hidden  # the final norm, the LM head (read even when tied)
    for sparse in sparse_layers(cfg):
        projections += hidden * (q + 2 * kv) + q * hidden  # q/k/v/o
        rest += biases + qk_norm + 2 * hidden  # their biases, q/k norms, the layer's two norms
        if not sparse:
            projections += 3 * hidden * cfg.intermediate_size
            continue
        rest += num_experts * hidden  # the router
        shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
        if shared:  # Qwen2-MoE's shared expert and its gate
            projections += 3 * hidden * shared
            rest += hidden
    return projections * proj + rest * dtype_bytes


def routed_step_bytes(distinct_experts: list[int], cfg, dtype_bytes: int = 2,
                      projection_bytes: int | None = None) -> list[int]:
    """Each step's floor bytes of weights, given the distinct (layer, expert) pairs it routed to."""
    dense = dense_step_bytes(cfg, dtype_bytes, projection_bytes)
    per_expert = expert_bytes(cfg, projection_bytes or dtype_bytes)
    return [dense + n * per_expert for n in distinct_experts]


def routed_floor_seconds(cfg, step_bytes: list[int], requests: int, prompt: int, new: int, ceilings,
                         prefill_s: float) -> float:
    """Weights read per step (measured routing) plus all cached K/V per decode step over the copy bandwidth, plus
    `prefill_s`: the prefill FLOPs of the parameters a prompt token reads (geometries.decode_bytes(cfg).gemm_s over
    the prompt tokens with top-k experts, head=False)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * 2
    kv = requests * kv_per_token * sum(prompt + k for k in range(new))
    return (sum(step_bytes) + kv) / ceilings.copy_bytes_s + prefill_s


class RouteRecorder:
    """Per engine step, the number of distinct (layer, expert) pairs its tokens were routed to. Each dispatched
    step is followed, on the compute stream, by a count of the nonzero routing counters and their reset; the
    counts come back once, in `distinct_per_step()`. Graph padding rows count too: run batches at bucket sizes."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.counts = engine.runner.decode_forward.count_routes()  # [L, E] int64, added to by every step
        if engine.runner.graphs is not None:  # the graphs captured at start-up count nothing: capture again
            engine.runner.graphs.capture()
        self._distinct: list[torch.Tensor] = []  # [] int64 device scalars, one per step

    @contextlib.contextmanager
    def watch(self):
        runner = self.engine.runner
        original = runner.dispatch

        def recorded(batch, *rest):
            step = original(batch, *rest)
            stream = runner.compute_stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._distinct.append((self.counts > 0).sum())
                self.counts.zero_()
            return step

        runner.dispatch = recorded
        try:
            yield self
        finally:
            runner.dispatch = original

    def distinct_per_step(self) -> list[int]:
        return torch.stack(self._distinct).tolist() if self._distinct else []

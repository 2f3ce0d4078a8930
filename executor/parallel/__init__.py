"""Tensor and pipeline parallelism: which part of the model a rank holds, and what passes
between ranks.

A model split over N ranks (Megatron-style, as vLLM and nano-vllm do it):

    qkv_proj, gate_up_proj   column-parallel: each rank computes its heads' / its slice of the
                             intermediate outputs; no communication
    o_proj, down_proj        row-parallel: each rank multiplies its slice of the inputs; the
                             partial sums are added across ranks (one all-reduce per layer half)
    logits                   the vocabulary split by rows; all-gathered so every rank holds the
                             whole row and samples the same token from the same bits
    embedding, norms         replicated

KV heads are split like query heads; with more ranks than KV heads, each KV head is replicated
on the N / num_kv_heads ranks whose query heads read it. A rank's model is an ordinary model
built from `local_arch` (its head and intermediate counts), so attention, the KV cache and its
sizing need no change; `shard_weight` cuts each checkpoint tensor to the rank's part.

Pipeline parallelism splits the layers into stages (zllm/config/parallel.py `stage_layers`),
each stage's ranks a tensor-parallel group of their own; a stage's model holds only its
layers (`PipelineParallel.layers`) and passes the residual stream to the next stage point to
point (`send` / `recv`). `init_parallel` joins a rank to both.

    groups.py           the ranks as process groups, their collectives, init_parallel
    shards.py           a rank's part of the model and of each checkpoint tensor
    pipeline_stage.py   a stage's two ends: the residual stream in and out

The room sits below the layers (their row-parallel all-reduce, the logits gather) and imports
no other room of the executor.
"""

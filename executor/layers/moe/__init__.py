"""A mixture-of-experts MLP over the flat token batch [T, hidden]: Qwen3-MoE, Qwen2-MoE (with
its shared expert), Mixtral and OLMoE, gpt-oss's and DeepSeek-V2's variants of the rule.

    router    logits = x W_r^T (+ b_r)                  [T, E]: one score per token and expert
    route     each token's top-k experts and their weights   route(), the rule's variant
    group     the T*k (token, expert) pairs sorted by expert, so each expert's rows sit together
    experts   per expert that has rows: y = down(act(gate_up(x_rows)))
    combine   out[t] = sum over its k pairs of w * y, added in expert order

    x [T, H] ── router ── top-k ──> pairs (t, e, w)  sorted by e:
        rows  | t3 t7 | t1 | t3 t4 t9 | ...      one gate_up and one down matmul per block
        e     |  e0   | e2 |    e5    | ...      (experts no token chose are never read)
    out[t] += w * y[row]   for every row of token t (index_add, rows in expert order)

Only the chosen experts' matrices are touched: a decode step of a few tokens reads k experts'
rows per token, not all E. ExpertMatrices holds one projection of every expert: a stacked
tensor [E, out, in] as a checkpoint's weights are held (fp32 on CPU, the model's dtype on a
GPU), or a GGUF file's blocks [E, out, bytes per row] (or a bf16/fp16 checkpoint's rows) that
the CPU kernel multiplies in place (csrc/cpu/gguf_linear.cpp): each expert's matrix is a view
of its rows, never widened (executor/weights/expert_blocks.py swaps them in).

    router.py       the rules (MoERule, one per family) and route()
    experts.py      ExpertMatrices (float or blocks), the experts' activation
    block.py        MoEBlock: router, experts, shared expert, the grouped combine
    checkpoint.py   each expert's checkpoint names from stacked, fused or Mixtral tensors
"""

"""Speculative decoding in the executor: proposers, and how the model runner uses them.

Each step, after sampling, the executor asks its proposer for up to k next tokens of every
request that sampled (`Proposer.propose`); they go back to the core with the step's output
(`ModelRunnerOutput.draft_token_ids`), and the core schedules them in the request's next step
beside its last token. The target model computes those k + 1 positions in one forward and the
sampler verifies them (`executor/sample/sampler.py: verify_drafts`, rejection sampling), so the
output is distributed exactly as without speculation.

    ngram.py         NgramProposer: prompt lookup in the sequence's own tokens (no model)
    draft_model.py   DraftModelProposer: a smaller model with its own paged KV cache

A proposer is anything with `after_step(stepped, propose_for) -> list[list[int]]`, called
every step after sampling with each scheduled request and the end of what the target computed
for it (a proposer with a KV cache catches up there), and the requests to propose for (those
that sampled, when the step speculates); and `copy_block(src, dst)` for copy-on-write. An
EAGLE-style head would be a third proposer, handed the target's hidden states as well.
"""

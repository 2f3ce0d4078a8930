"""Just enough of an engine to drive a model through paged attention, for the model tests
that compare logits and greedy tokens with transformers: sequences, block tables, slots."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zllm.executor.attention.paged import AttentionMetadata
from zllm.executor.models.llama import LlamaForCausalLM


@dataclass
class Sequence:
    """A sequence's tokens (its prompt, then what was sampled), its blocks, and how many of
    its tokens are in the cache."""

    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0


class PagedRunner:
    """Just enough of an engine to drive the model: block tables, slots, greedy sampling."""

    def __init__(self, model: LlamaForCausalLM, block_size: int = 4, num_blocks: int = 64):
        arch = model.arch
        shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        gen = torch.Generator().manual_seed(1)
        # Garbage in unused slots: a read through a wrong slot would change the results.
        self.kv_caches = [torch.randn(shape, generator=gen) for _ in range(arch.num_layers)]
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.model, self.block_size = model, block_size

    @torch.inference_mode()
    def step(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run `num_new` tokens of each sequence; returns the logits of every new token."""
        input_ids, positions, slots = [], [], []
        for seq, num_new in work:
            end = seq.num_computed + num_new
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free_blocks.pop())
            for pos in range(seq.num_computed, end):
                input_ids.append(seq.tokens[pos])
                positions.append(pos)
                block = seq.blocks[pos // self.block_size]
                slots.append(block * self.block_size + pos % self.block_size)
        meta = AttentionMetadata.build(
            query_lens=[n for _, n in work],
            seq_lens=[seq.num_computed + n for seq, n in work],
            block_tables=[seq.blocks for seq, _ in work],
            slot_mapping=slots,
            block_size=self.block_size,
            device="cpu",
        )
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta)
        for seq, num_new in work:
            seq.num_computed += num_new
        return self.model.compute_logits(hidden)

    def step_and_sample(self, work: list[tuple[Sequence, int]]) -> None:
        """Greedy-append a token to every sequence whose known tokens are now all computed."""
        logits = self.step(work)
        ends = torch.tensor([n for _, n in work]).cumsum(0) - 1
        for (seq, _), token in zip(work, logits[ends].argmax(-1).tolist(), strict=True):
            if seq.num_computed == len(seq.tokens):
                seq.tokens.append(token)

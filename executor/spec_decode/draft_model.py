"""Draft-model proposals: a smaller model with the target's tokenizer proposes k tokens by
greedy decoding, with a paged KV cache of its own.

The draft's KV cache uses the target's block ids (the first KV cache group's table, which
is full attention), in tensors of its own shape, so the block manager allocates for both at
once and a prefix-cache hit is a hit for the draft too. That holds because the draft
computes every position the target does, in the same step: after the target's forward
(and sampling), `after_step` catches each request's draft up to its known tokens:

    target step          verify [x, e1 .. ed] at positions p .. p+d; accepted a, new token y
    draft catch-up       the tokens it has not computed yet (a prompt chunk, the accepted
                         proposals it did not write itself, y) in one flat forward
    draft proposals      argmax at y -> e1', then k - 1 one-token decodes -> e2' .. ek'

A proposal's keys and values are written while proposing (the core reserves
`lookahead_slots` for them); those of proposals the target then accepts are kept
(`RequestState.draft_tail`), the others are overwritten by the next catch-up. Positions
past the request's allocated blocks are never written: proposing stops there.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from zllm.config.engine import EngineConfig
from zllm.executor.attention.backend import choose_attention_backend
from zllm.executor.models import model_class_of
from zllm.executor.requests.state import RequestState
from zllm.executor.weights.loader import load_weights

logger = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, num_blocks: int, dtype: torch.dtype) -> None:
        spec = config.speculative
        assert spec is not None and spec.draft_arch is not None and spec.draft_model_path
        self.k = spec.num_speculative_tokens
        self.arch = arch = spec.draft_arch
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.attention = choose_attention_backend(self.device, dtype, arch.head_dim)
        model = model_class_of(arch)(arch, dtype=dtype, attention=self.attention)
        model.load_weights(load_weights(spec.draft_model_path, arch))
        self.model = model.to(self.device).eval()
        shape = (2, num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(arch.num_layers)
        ]
        logger.info(
            "Draft model %s: %d layers, proposing %d tokens (attention: %s)",
            spec.model,
            arch.num_layers,
            self.k,
            self.attention.name,
        )

    @staticmethod
    def kv_bytes_per_slot(config: EngineConfig, dtype: torch.dtype) -> int:
        """What the draft adds to one KV slot of the pool."""
        spec = config.speculative
        if spec is None or spec.draft_arch is None:
            return 0
        elem = torch.empty((), dtype=dtype).element_size()
        arch = spec.draft_arch
        return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * elem

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write of a shared block: the draft's part of it too."""
        for kv in self.kv_caches:
            kv[:, dst].copy_(kv[:, src])

    @torch.inference_mode()
    def after_step(
        self,
        stepped: list[tuple[RequestState, int]],
        propose_for: list[RequestState],
    ) -> list[list[int]]:
        """Catch the draft up on what the target computed this step, then propose for
        `propose_for` (requests that sampled). `stepped`: each scheduled request with the
        end of what the target computed for it this step."""
        bs = self.block_size
        proposing = {st.req_id for st in propose_for}
        batch: list[tuple[RequestState, int, int]] = []  # state, start, end
        for st, target_end in stepped:
            _accept_tail(st)
            capacity = len(st.block_ids[0]) * bs
            # A request that sampled knows one token more than the target computed.
            end = len(st.all_token_ids) if st.req_id in proposing else target_end
            end = min(end, capacity)
            if end > st.draft_num_computed:
                batch.append((st, st.draft_num_computed, end))
        last_rows: dict[str, int] = {}
        if batch:
            hidden = self._forward(
                [st.all_token_ids[start:end] for st, start, end in batch],
                [(st, start, end) for st, start, end in batch],
            )
            row = 0
            for st, start, end in batch:
                row += end - start
                st.draft_num_computed = end
                if st.req_id in proposing and end == len(st.all_token_ids):
                    last_rows[st.req_id] = row - 1
        if not last_rows:
            return [[] for _ in propose_for]
        # First proposal from the catch-up's last row; then one-token decodes.
        order = [st for st in propose_for if st.req_id in last_rows]
        rows = torch.as_tensor([last_rows[st.req_id] for st in order])
        tokens = self.model.compute_logits(hidden[rows]).argmax(dim=-1).tolist()
        proposals = {st.req_id: [t] for st, t in zip(order, tokens, strict=True)}
        for _ in range(self.k - 1):
            # Write the newest proposal's KV (at the next free position) and read the next.
            step = []
            for st in order:
                pos = len(st.all_token_ids) + len(proposals[st.req_id]) - 1
                if pos < len(st.block_ids[0]) * bs:
                    step.append((st, pos))
            if not step:
                break
            hidden = self._forward(
                [[proposals[st.req_id][-1]] for st, _ in step],
                [(st, pos, pos + 1) for st, pos in step],
            )
            tokens = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for (st, _), token in zip(step, tokens, strict=True):
                proposals[st.req_id].append(token)
            order = [st for st, _ in step]
        for st in propose_for:
            # Proposals whose KV the draft wrote: all but the last one.
            st.draft_tail = proposals.get(st.req_id, [])[:-1]
        return [proposals.get(st.req_id, []) for st in propose_for]

    def _forward(
        self, token_lists: list[list[int]], spans: list[tuple[RequestState, int, int]]
    ) -> torch.Tensor:
        """The draft over a flat batch: `token_lists[i]` at positions spans[i] of request i,
        attending to its cache (the first KV cache group's block table)."""
        bs = self.block_size
        positions = [np.arange(start, end, dtype=np.int64) for _, start, end in spans]
        tables = [st.block_ids[0] for st, _, _ in spans]
        slots = [
            np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
            for table, pos in zip(tables, positions, strict=True)
        ]
        metadata = self.attention.build_metadata(
            query_lens=[end - start for _, start, end in spans],
            seq_lens=[end for _, _, end in spans],
            block_tables=tables,
            slot_mapping=np.concatenate(slots),
            block_size=bs,
            device=self.device,
        )
        input_ids = torch.tensor(
            [t for tokens in token_lists for t in tokens], dtype=torch.int64, device=self.device
        )
        return self.model(
            input_ids,
            torch.from_numpy(np.concatenate(positions)).to(self.device),
            self.kv_caches,
            metadata,
        )


def _accept_tail(st: RequestState) -> None:
    """The proposals whose KV the draft wrote last step and the target accepted are computed:
    they are the tokens that now follow the draft's computed ones."""
    tail = st.draft_tail
    if not tail:
        return
    known = st.all_token_ids
    start = st.draft_num_computed
    matched = 0
    while (
        matched < len(tail)
        and start + matched < len(known)
        and known[start + matched] == tail[matched]
    ):
        matched += 1
    st.draft_num_computed += matched
    st.draft_tail = []

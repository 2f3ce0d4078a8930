"""How the scheduler steps through prompts with images (real scheduler parts, no model):
each step starts at most SchedulerConfig.max_num_encoder_tokens of images (the encoder's
work beside the token budget), a chunk stops before an image that does not fit and the image
goes in a later step; Gemma 3's images (two-way attention) are never cut by a chunk."""

from __future__ import annotations

import hashlib

from scheduler_parts import BS

from zllm.config.engine import SchedulerConfig
from zllm.core.kv.block_manager import BlockManager
from zllm.core.request import Request, RequestStatus
from zllm.core.scheduler import Scheduler
from zllm.protocol import ImageData, ModelRunnerOutput, PlacedImage
from zllm.sampling_params import SamplingParams


def image_request(req_id: str, prompt_len: int, spans: list[tuple[int, int]], whole=False):
    """A request whose prompt holds images at `spans` (offset, length), each its own."""
    images = [
        PlacedImage(
            ImageData(b"", 8, 8, hashlib.sha256(f"{req_id}{i}".encode()).hexdigest()),
            offset,
            length,
        )
        for i, (offset, length) in enumerate(spans)
    ]
    return Request(
        req_id=req_id,
        prompt_token_ids=list(range(prompt_len)),
        sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
        images=images,
        whole_images=whole,
    )


def scheduler(budget: int, encoder_budget: int) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=256,
        max_num_encoder_tokens=encoder_budget,
    )
    return Scheduler(config, BlockManager(100, BS))


def step(sched: Scheduler) -> dict[str, int]:
    so = sched.schedule()
    done = [r for r in so.num_scheduled_tokens if sched.requests[r].num_pending_tokens]
    done = [
        r for r in done if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens
    ]
    sched.update_from_output(
        so, ModelRunnerOutput(step_id=so.step_id, req_ids=done, sampled_token_ids=[[7]] * len(done))
    )
    return dict(so.num_scheduled_tokens)


def test_each_step_starts_images_within_the_encoder_budget() -> None:
    sched = scheduler(budget=64, encoder_budget=8)
    sched.add_request(image_request("a", 30, [(2, 6), (12, 6)]))
    sched.add_request(image_request("b", 20, [(4, 6)]))
    # a's first image fits the encoder's 8 tokens, its second would pass them: a stops at
    # 12; b's text before its image goes in the 2 left.
    assert step(sched) == {"a": 12, "b": 4}
    assert step(sched) == {"a": 18}  # a's second image takes 6: b's would pass 8
    assert step(sched) == {"a": 1, "b": 16}
    assert step(sched) == {"b": 1}  # (a is done: its two tokens)


def test_an_image_the_size_of_the_budget_runs_alone() -> None:
    sched = scheduler(budget=64, encoder_budget=8)
    sched.add_request(image_request("a", 12, [(0, 8)]))
    sched.add_request(image_request("b", 12, [(0, 8)]))
    assert step(sched) == {"a": 12}
    assert step(sched) == {"a": 1, "b": 12}


def test_whole_images_are_not_cut_by_a_chunk() -> None:
    """Gemma 3's (two-way attention): ten tokens a step end before the image at 6..14 rather
    than inside it; causal images (Qwen2.5-VL's) are cut like text."""
    sched = scheduler(budget=10, encoder_budget=64)
    sched.add_request(image_request("a", 20, [(6, 8)], whole=True))
    assert step(sched) == {"a": 6}
    assert step(sched) == {"a": 10}
    causal = scheduler(budget=10, encoder_budget=64)
    causal.add_request(image_request("a", 20, [(6, 8)]))
    assert step(causal) == {"a": 10}
    assert step(causal) == {"a": 10}


def test_an_image_larger_than_the_encoder_budget_runs_in_a_step_of_its_own() -> None:
    """A thin image scaled up can take more tokens than the budget's floor: a step that has
    started no image takes it (else it would wait forever, and every request behind it)."""
    sched = scheduler(budget=64, encoder_budget=8)
    sched.add_request(image_request("a", 20, [(2, 12)]))
    sched.add_request(image_request("b", 10, [(0, 4)]))
    assert step(sched) == {"a": 20}  # (b's image would pass the budget a's took)
    assert step(sched) == {"a": 1, "b": 10}


def test_encoder_tokens_count_the_images_a_chunk_starts() -> None:
    req = image_request("a", 40, [(2, 6), (12, 6), (30, 4)])
    assert req.encoder_tokens(0, 12) == 6  # the second image starts at 12: the next chunk's
    assert req.encoder_tokens(4, 20) == 6  # resumed inside the first: read from the cache
    assert req.encoder_tokens(10, 30) == 10


def test_a_forked_sample_keeps_its_images_whole() -> None:
    """n > 1 samples and beams fork the request: a fork recomputed after preemption must keep
    Gemma 3's images in one chunk as its parent does."""
    parent = image_request("a", 20, [(6, 8)], whole=True)
    child = parent.fork("a#1", sample_index=1, output_token_ids=[], num_computed_tokens=0,
                        status=RequestStatus.WAITING)  # fmt: skip
    assert child.whole_images and child.images == parent.images
    assert child.chunk_end(0, 10) == 6

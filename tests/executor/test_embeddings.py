"""Embeddings: the prompt's final hidden states (after the model's last norm), pooled by mean
or last token and L2-normalized, against transformers' own hidden states; offline
(`LLM.embed`) and through `zllm serve` with the official openai client (which asks for
base64)."""

from __future__ import annotations

import pytest
import torch

from zllm import LLM

PROMPTS = [
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
    "hi",
    "Paged attention stores keys and values in fixed-size blocks.",
]


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()


def reference(hf, token_ids: list[int], pooling: str) -> torch.Tensor:
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([token_ids])).last_hidden_state[0]
    vector = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(vector, dim=0)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embed_matches_transformers_hidden_states(tiny_llama_dir, hf, pooling) -> None:
    # 8-token steps: the long prompt is pooled over several prefill chunks.
    llm = LLM(tiny_llama_dir, pooling=pooling, block_size=4, max_num_batched_tokens=8)
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    assert len(outputs[0].prompt_token_ids) > 16
    for out in outputs:
        ours = torch.tensor(out.outputs.embedding)
        assert ours.shape == (hf.config.hidden_size,)
        torch.testing.assert_close(
            ours, reference(hf, out.prompt_token_ids, pooling), atol=1e-5, rtol=0
        )
    # The same prompt again: computed again (a prefix-cache hit would skip positions a mean
    # needs), so the same vector (up to the order of the float sums over other chunks).
    again = llm.embed(PROMPTS[0], use_tqdm=False)[0]
    ours, before = torch.tensor(again.outputs.embedding), torch.tensor(outputs[0].outputs.embedding)
    torch.testing.assert_close(ours, before, atol=1e-6, rtol=0)
    assert llm.engine.block_manager.prefix_cache_hits == 0


def test_embed_under_preemption(tiny_llama_dir, hf) -> None:
    llm = LLM(tiny_llama_dir, block_size=4, num_gpu_blocks_override=12, max_num_batched_tokens=8)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0] + " More.", PROMPTS[2] + " More."]
    outputs = llm.embed(prompts, use_tqdm=False)
    for out in outputs:
        ours = torch.tensor(out.outputs.embedding)
        torch.testing.assert_close(
            ours, reference(hf, out.prompt_token_ids, "mean"), atol=1e-5, rtol=0
        )


@pytest.mark.e2e
def test_served_embeddings(tiny_llama_dir, engine_pool, tmp_path) -> None:
    import openai

    offline = LLM(tiny_llama_dir).embed(PROMPTS, use_tqdm=False)
    log = tmp_path / "server.log"
    with engine_pool.serve(tiny_llama_dir, log, "--served-model-name", "tiny") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        answer = client.embeddings.create(model="tiny", input=PROMPTS)  # base64 on the wire
        assert [d.index for d in answer.data] == [0, 1, 2]
        for data, out in zip(answer.data, offline, strict=True):
            torch.testing.assert_close(
                torch.tensor(data.embedding), torch.tensor(out.outputs.embedding), atol=1e-6, rtol=0
            )
        assert answer.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline)
        floats = client.embeddings.create(
            model="tiny", input=[offline[1].prompt_token_ids], encoding_format="float"
        )
        torch.testing.assert_close(
            torch.tensor(floats.data[0].embedding),
            torch.tensor(offline[1].outputs.embedding),
            atol=1e-6,
            rtol=0,
        )
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client.embeddings.create(model="tiny", input="hi", dimensions=8)

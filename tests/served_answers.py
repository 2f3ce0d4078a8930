"""What a running `zllm serve` answers, for the tests that compare a server's answers with
another's or with the offline engine's: greedy completions, a beam search's beams, and a
metric per data-parallel engine."""

from __future__ import annotations

import re

import openai
from servers import Server, wait_until


def greedy(
    base_url: str, prompts: list[str], max_tokens: int = 24, stream: bool = False
) -> list[str]:
    """Each prompt's greedy completion text (streamed and joined with `stream`)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    outs = []
    for prompt in prompts:
        kw = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        if stream:
            chunks = client.completions.create(**kw, stream=True)
            outs.append("".join(c.choices[0].text for c in chunks if c.choices))
        else:
            outs.append(client.completions.create(**kw).choices[0].text)
    return outs


def beam_texts(url: str, prompt: str) -> list[str]:
    """A served beam search's 3 beams (best first) for `prompt`, through the openai client."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=6, n=3,
        extra_body={"use_beam_search": True, "beam_width": 3},
    )  # fmt: skip
    return [c.text for c in sorted(answer.choices, key=lambda c: c.index)]


def per_engine(text: str, name: str) -> dict[str, float]:
    """A metric's value per `engine` label, summed over its other labels."""
    values: dict[str, float] = {}
    for m in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        engine = re.search(r'engine="(\d+)"', m.group(1)).group(1)
        values[engine] = values.get(engine, 0.0) + float(m.group(2))
    return values


def assert_every_engine_served(server: Server, count: int) -> None:
    """A data-parallel server's engines answered `count` requests in all, each some."""

    def served() -> dict[str, float]:
        return per_engine(server.get("/metrics").text, "zllm:tenant_requests_total")

    assert wait_until(lambda: sum(served().values()) == count, 30), served()
    assert min(served().values()) >= 1, served()

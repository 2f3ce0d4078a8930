"""Chat workloads for `zllm bench serve --dataset`: prompts whose answers repeat their input
(`edit`: rewrite a given piece of code or text) and prompts whose answers do not (`free`:
open-ended writing). Speculative decoding by prompt lookup pays on the first and not on the
second. The texts are written for this benchmark; each prompt goes through the model's chat
template and is sent as token ids, so every engine sees the same tokens.
"""

from __future__ import annotations

import random

DATASETS = ("random", "edit", "free")

_CODE = [
    """def load_inventory(path):
    inventory = {}
    with open(path) as handle:
        for line in handle:
            name, count, price = line.strip().split(",")
            inventory[name] = {"count": int(count), "price": float(price)}
    return inventory


def inventory_value(inventory):
    total = 0.0
    for name, item in inventory.items():
        total += item["count"] * item["price"]
    return total


def restock(inventory, name, count):
    if name not in inventory:
        inventory[name] = {"count": 0, "price": 0.0}
    inventory[name]["count"] += count
    return inventory[name]["count"]
""",
    """class RingBuffer:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = [None] * capacity
        self.start = 0
        self.size = 0

    def push(self, value):
        index = (self.start + self.size) % self.capacity
        self.items[index] = value
        if self.size < self.capacity:
            self.size += 1
        else:
            self.start = (self.start + 1) % self.capacity

    def pop(self):
        if self.size == 0:
            raise IndexError("pop from an empty RingBuffer")
        value = self.items[self.start]
        self.start = (self.start + 1) % self.capacity
        self.size -= 1
        return value
""",
    """function parseQuery(query) {
  const params = {};
  for (const part of query.replace(/^\\?/, "").split("&")) {
    if (!part) continue;
    const [key, value = ""] = part.split("=");
    const name = decodeURIComponent(key);
    const text = decodeURIComponent(value);
    if (name in params) {
      params[name] = [].concat(params[name], text);
    } else {
      params[name] = text;
    }
  }
  return params;
}

function buildQuery(params) {
  return Object.entries(params)
    .map(([key, value]) => `${encodeURIComponent(key)}=${encodeURIComponent(value)}`)
    .join("&");
}
""",
    """def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda interval: interval[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    covered = 0
    for start, end in merge_intervals(intervals):
        covered += end - start
    return covered


def gaps(intervals):
    merged = merge_intervals(intervals)
    return [[a[1], b[0]] for a, b in zip(merged, merged[1:])]
""",
]

_RENAMES = [
    ("inventory", "stock"),
    ("capacity", "max_items"),
    ("params", "fields"),
    ("merged", "joined"),
]

_PROSE = [
    "The harbour town wakes early. Before the sun clears the hills, the fishing boats are "
    "already coming back, their decks stacked with crates, and the gulls follow them in. "
    "By seven the market is loud with prices called across the stalls, and by nine the "
    "cafés along the quay are full of people who were up before dawn and want breakfast.",
    "Our team moved the build system to a new set of machines last spring. The move took "
    "three weeks instead of one, mostly because the old machines had tools installed by "
    "hand that nobody had written down. We now keep every tool in a lock file, and a new "
    "machine is ready in an hour instead of a day.",
]

_TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "the first day of school on a space station",
    "a chess game between two old friends",
    "a city where it has not rained for a year",
    "a robot learning to bake bread",
    "a train that never reaches its last stop",
    "the night the power went out in a small village",
    "a cat that keeps visiting the same library",
]


def chat_messages(dataset: str, index: int) -> list[dict[str, str]]:
    """The conversation of prompt `index` of `dataset` ("edit" or "free")."""
    if dataset == "edit":
        if index % 3 == 2:
            text = _PROSE[index // 3 % len(_PROSE)]
            ask = f"Copy this paragraph exactly, fixing any typos:\n\n{text}"
        else:
            k = index % len(_CODE)
            old, new = _RENAMES[k]
            ask = (
                f"Rename `{old}` to `{new}` everywhere in this code and give back the whole "
                f"code, unchanged otherwise:\n\n{_CODE[k]}"
            )
        return [{"role": "user", "content": ask}]
    if dataset == "free":
        topic = _TOPICS[index % len(_TOPICS)]
        return [{"role": "user", "content": f"Write a short story about {topic}."}]
    raise ValueError(f"dataset must be one of {', '.join(DATASETS)}; got {dataset!r}")


def chat_prompts(dataset: str, num_prompts: int, tokenizer_model: str | None, seed: int) -> list:
    """Token ids of `num_prompts` chat prompts of `dataset`, in a seeded order."""
    from zllm.model.files import resolve_model
    from zllm.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(tokenizer_model))
    order = list(range(num_prompts))
    random.Random(seed).shuffle(order)
    prompts = []
    for index in order:
        text = tokenizer.apply_chat_template(chat_messages(dataset, index))
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, avoiding the first 256 ids (special and byte tokens)."""
    rng = random.Random(seed)
    low = min(256, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]

"""Sixteen short chat prompts: the SmolLM2 GPU-vs-CPU parity checks (tests/test_cuda.py and
benchmarks/serve_parity.py) share them."""

SMOLLM2_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain paged attention in one sentence.", "List three prime numbers.",
    "def fibonacci(n):", "Translate 'good morning' into Spanish.",
    "Why is the sky blue?", "Give me a short motivational quote.",
    "What does a GPU do?", "Name a famous painter and one of their works.",
    "Summarize the plot of Romeo and Juliet in two sentences.", "What is 17 times 23?",
    "Write a SQL query that counts rows in a table named users.",
    "What is the boiling point of water in Fahrenheit?", "Suggest a name for a pet turtle.",
    "Describe the taste of a lemon.",
]  # fmt: skip

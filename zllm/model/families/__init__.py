"""One module per model family: the names it answers to, how its files read, its GGUF tensor
names, what it can do and where its model code lives (zllm/model/family.py says what a
family holds; zllm/model/registry.py lists them). docs/adding-a-model.md walks through
adding one."""

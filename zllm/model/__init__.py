"""Model files: the registry and cache of named models (and the chat templates shipped for
them), the GGUF reader, architecture configs, which code runs a model (`--model-impl`), and the
progress of the long waits before one serves."""

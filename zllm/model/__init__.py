"""Model files: the registry and cache of named models, the GGUF reader, architecture configs,
and which code runs a model (`--model-impl`)."""

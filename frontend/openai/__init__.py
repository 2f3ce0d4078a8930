"""OpenAI's completions, chat, embeddings and batch APIs: bodies, formats, choices."""

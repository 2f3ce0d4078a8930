"""OpenAI's Responses API: input, output items and their stream."""

"""Anthropic's Messages API: bodies, output and extended thinking."""

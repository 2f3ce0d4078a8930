"""Text: tokenizers, chat templates, incremental detokenizing, tool-call and reasoning parsers,
grammars."""

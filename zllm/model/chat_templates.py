"""Chat templates zllm ships for registered models whose files carry none (Jinja, rendered by
zllm/text/tokenizer.py like a model's own)."""

from __future__ import annotations

# Gemma's turn format: `<start_of_turn>{user|model}\n...<end_of_turn>\n`, an assistant turn is
# a "model" turn, and Gemma has no system role, so a system prompt opens the first user turn.
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_prefix = '' -%}"
    "{%- set turns = messages -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{{- (system_prefix if loop.first else '') + (message['content'] | trim) }}"
    "{{- '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

"""`continue_final_message` (vLLM's chat extra, transformers' apply_chat_template argument):
the conversation's last message, usually an assistant's, is left open so the model goes on
writing it instead of starting a new turn.

    rendered without a generation prompt:   ...<|im_start|>assistant\\nThe answer is<|im_end|>\\n
    left open:                              ...<|im_start|>assistant\\nThe answer is
                                                                                  └ cut here

The template renders the whole conversation, then everything after the last occurrence of
the final message's text (stripped: templates often trim content) is cut: the turn's end
marker and whatever follows. A generation prompt would open a new turn after it, so the two
do not combine. No torch here.
"""

from __future__ import annotations

from typing import Any


def final_message_text(messages: list[dict[str, Any]]) -> str:
    """The text the model continues: the last message's content (its last text part)."""
    if not messages:
        raise ValueError("continue_final_message needs a message to continue.")
    content = messages[-1].get("content")
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict)]
        content = next((t for t in reversed(texts) if isinstance(t, str)), None)
    if not isinstance(content, str):
        raise ValueError("continue_final_message: the final message has no text to continue.")
    return content


def leave_final_message_open(rendered: str, messages: list[dict[str, Any]]) -> str:
    """`rendered` (the conversation, no generation prompt) cut right after the final
    message's text."""
    text = final_message_text(messages).strip()
    if not text:  # where an empty message starts is not findable in the rendering
        raise ValueError("continue_final_message: the final message is empty.")
    at = rendered.rfind(text)
    if at < 0:
        raise ValueError(
            "continue_final_message: the final message's text does not appear in the "
            "rendered chat template, so there is nothing to leave open."
        )
    return rendered[: at + len(text)]

"""Incremental detokenization and stop strings for one sequence.

Decoding the whole sequence after every token costs O(n^2). Instead a `tokenizers`
DecodeStream keeps a small window of previous ids and emits only the new text, holding back
bytes until they form whole UTF-8 characters (byte-fallback tokens included). The stream is
primed with the prompt's last few tokens so the first output token decodes with the right
leading space (stopping before a prompt that ends inside a character: the output's text is
its own tokens', never a piece of the prompt's).

Stop strings: the text ends *before* a stop string (unless `include_stop_str_in_output`).
While streaming, the last `max(len(stop)) - 1` characters are held back, since they could be
the start of a stop string that the next token completes.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from zllm.protocol import PROMPT_TAIL_TOKENS
from zllm.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        self._prime = self._clean_prime(prompt_token_ids[-PROMPT_TAIL_TOKENS:])
        self._stream = DecodeStream(list(self._prime), skip_special_tokens=skip_special_tokens)
        self._output_ids: list[int] = []
        self._stopped = False  # a stop string cut the text
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.output_text = ""
        self._num_sent_chars = 0  # how much of output_text was handed out as deltas

    def _clean_prime(self, tail: Sequence[int]) -> list[int]:
        """The prompt's last tokens, without those that end it inside a UTF-8 character (a
        byte-fallback or byte-level token): primed with one, DecodeStream's first piece
        repeats the primed text itself, and the prompt's text would leak into the output."""
        prime = list(tail)
        while prime and self._tokenizer.decode(
            prime, skip_special_tokens=self._skip_special_tokens
        ).endswith("\ufffd"):
            prime.pop()
        return prime

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Decode new tokens; returns the stop string that matched, if one did."""
        for token_id in new_token_ids:
            self._output_ids.append(token_id)
            piece = self._step(token_id)
            if not piece:
                continue
            prev_len = len(self.output_text)
            self.output_text += piece
            matched = self._check_stop(prev_len)
            if matched is not None:
                return matched
        return None

    def _step(self, token_id: int) -> str | None:
        """The stream's next piece. SentencePiece's byte fallback decodes a run of byte tokens
        that is not UTF-8 as one U+FFFD per byte, so a byte token can turn text already
        handed out (a valid byte before it) into U+FFFD; DecodeStream then refuses ("Invalid
        prefix encountered"). Text handed out stays: the stream restarts from the output's
        last tokens that still decode cleanly (none if they fail too), and goes on."""
        try:
            return self._stream.step(self._tokenizer, token_id)
        except Exception as exc:  # tokenizers raises a bare Exception
            if "Invalid prefix" not in str(exc):
                raise
        skip = self._skip_special_tokens
        prime = self._clean_prime(self._output_ids[-PROMPT_TAIL_TOKENS - 1 : -1])
        self._stream = DecodeStream(prime, skip_special_tokens=skip)
        try:
            return self._stream.step(self._tokenizer, token_id)
        except Exception as exc:
            if "Invalid prefix" not in str(exc):
                raise
        self._stream = DecodeStream([], skip_special_tokens=skip)
        return self._stream.step(self._tokenizer, token_id)

    def _check_stop(self, prev_len: int) -> str | None:
        if not self.stop:
            return None
        best_idx, best_stop = -1, None
        for stop in self.stop:
            # Only where the new text could have completed it.
            idx = self.output_text.find(stop, max(0, prev_len - len(stop) + 1))
            if idx != -1 and (best_idx == -1 or idx < best_idx):
                best_idx, best_stop = idx, stop
        if best_stop is None:
            return None
        end = best_idx + len(best_stop) if self.include_stop_str_in_output else best_idx
        self.output_text = self.output_text[:end]
        self._stopped = True
        return best_stop

    def take_delta(self, finished: bool) -> str:
        """The text not yet handed out; holds back a possible stop-string start unless finished."""
        if finished and not self._stopped:
            self._flush()
        limit = len(self.output_text) if finished else len(self.output_text) - self._holdback
        if limit <= self._num_sent_chars:
            return ""
        delta = self.output_text[self._num_sent_chars : limit]
        self._num_sent_chars = limit
        return delta

    def _flush(self) -> None:
        """At the end, bytes the stream still holds (a UTF-8 character the last tokens did not
        complete) come out as U+FFFD, as decoding the whole output does."""
        if not self._output_ids:
            return
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        head = decode(self._prime, skip_special_tokens=skip)
        whole = decode(self._prime + self._output_ids, skip_special_tokens=skip)
        if whole.startswith(head):
            text = whole[len(head) :]
            if len(text) > len(self.output_text) and text.startswith(self.output_text):
                self.output_text = text
        self._output_ids = []

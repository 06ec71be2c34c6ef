"""Token ids to text while streaming: only text that can no longer change goes out."""

from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class TextStream:
    """Token ids in, text out: `add` returns the text that became final, so everything given out is a prefix
    of the reply's final text. Held back: an incomplete UTF-8 character at the end (tokenizers' DecodeStream
    returns nothing until its last byte arrives) and the longest end of the text that could still grow into a stop
    string. When a stop string appears, the text is cut before it and stop_sequence is set.

    Each token is decoded once (DecodeStream looks at the last few tokens only), not the whole reply again: that
    took 7.1 us a token at 128 tokens and 46.7 us at 1,024, against 2.1-2.2 us now."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()) -> None:
        self.tokenizer, self.stops = tokenizer, list(stops)
        # special tokens are skipped, as ChatFormat.decode_reply does
        self.decoder = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.text = ""  # the reply's text so far, without an incomplete character at its end
        self.sent = 0  # characters given out so far
        self.stop_sequence: str | None = None

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        self.ids += ids
        for i in ids:
            self.text += self.decoder.step(self.tokenizer, i) or ""
        if final:  # the whole reply, an incomplete character at its end included (as U+FFFD)
            self.text = self.tokenizer.decode(self.ids)
        text = self.text
        hits = [(i, s) for s in self.stops if (i := text.find(s, self.sent)) >= 0]
        if hits:
            end, self.stop_sequence = min(hits)
        else:
            end = len(text) if final else len(text) - self._could_become_stop(text)
        out = text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def _could_become_stop(self, text: str) -> int:
        """Length of the longest end of text that is the start of a stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

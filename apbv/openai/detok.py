"""Incremental detokenization of a streamed answer: each new token costs the same, however
long the answer already is.

:class:`IncrementalText` turns token ids, one at a time, into the text a client may be sent
now: the new text of the token (``tokenizers``' ``DecodeStream`` when the tokenizer has a fast
backend; else a decode of the last few tokens, vLLM's prefix/read offsets), held back while
it ends inside a UTF-8 sequence or with what could begin a stop text, and nothing from the
first stop text on. Stop texts are looked for in the new text and the few characters before
it only, so no step rescans the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import tokenizers

TAIL_TOKENS = 6
"""Tokens of context the fallback decoder decodes before a new one (a character split over
more byte tokens than that is rare; a longer one is still right, only held back longer)."""


class Tokenizer(Protocol):
    """What the server needs of a tokenizer (a ``transformers`` tokenizer has it): token ids
    to text."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


class _TailDecoder:
    """The text each new token adds, from a decode of the last few tokens only (for
    tokenizers without a ``DecodeStream``): the decode of the kept tail with the new token
    minus the decode of the tail before it (``read`` tokens), once it no longer ends in an
    incomplete UTF-8 sequence; then only :data:`TAIL_TOKENS` tokens are kept."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.read = 0

    def step(self, token: int) -> str | None:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[:self.read], skip_special_tokens=True)
        now = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return None
        del self.ids[:max(0, len(self.ids) - TAIL_TOKENS)]  # cost and memory stay bounded
        self.read = len(self.ids)
        return now[len(before):]


class _Backend:
    """``tokenizers``' ``DecodeStream`` over a fast tokenizer's backend."""

    def __init__(self, backend: tokenizers.Tokenizer):
        from tokenizers.decoders import DecodeStream

        self.stream, self.backend = DecodeStream(skip_special_tokens=True), backend

    def step(self, token: int) -> str | None:
        return self.stream.step(self.backend, token)


def _decoder(tokenizer: Tokenizer) -> _Backend | _TailDecoder:
    """:class:`_Backend` when the tokenizer has a fast backend (and ``tokenizers`` its
    ``DecodeStream``), else :class:`_TailDecoder`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            return _Backend(backend)
        except ImportError:
            pass
    return _TailDecoder(tokenizer)


class IncrementalText:
    """The sendable text of an answer streamed token by token (see the module's doc)."""

    def __init__(self, tokenizer: Tokenizer, stop_texts: Sequence[str] = ()):
        self.decoder = _decoder(tokenizer)
        self.stop_texts = tuple(stop_texts)
        self.hold = max(map(len, self.stop_texts), default=1) - 1
        self.pending = ""
        """Decoded text not sent yet: at most ``hold`` characters between calls."""
        self.stopped = False
        """A stop text was found: nothing more is sent."""

    def add(self, token: int) -> str:
        """Feed one token: the text that may be sent now (often empty)."""
        piece = "" if self.stopped else self.decoder.step(token) or ""
        if not piece:
            return ""
        text = self.pending + piece
        found = [i for i in (text.find(s) for s in self.stop_texts) if i >= 0]
        if found:
            self.pending, self.stopped = "", True
            return text[:min(found)]
        ready = max(0, len(text) - self.hold)
        self.pending = text[ready:]
        return text[:ready]

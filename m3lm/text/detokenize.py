"""Token ids to text as they stream: incremental detokenizing and stop strings.

`TextStream` is what every caller of the engine (`LLM`, `generate`, the server) turns a request's
ids into text with; the engine itself emits ids only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from m3lm.core import SamplingParams, StepOutput
    from m3lm.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character
# Prompt tokens decoded ahead of the first output token, for decoders whose output depends on neighbours.
PROMPT_CONTEXT = 4
# After this many held-back tokens a trailing U+FFFD is taken for invalid bytes, not a character in progress.
MAX_PENDING = 12
# Tokens left behind such a forced boundary: 8 tokens of at least one byte each decode to at least 3
# characters (a U+FFFD stands for at most 3 bytes), as the boundary check needs.
CUT_TAIL = 8


class IncrementalDetokenizer:
    """Turns a stream of token ids into text increments whose concatenation equals `decode(ids)`.

    Each step decodes a short window only: the tokens emitted at the last step (context for decoders
    whose output depends on neighbours) followed by the tokens not yet final. Text ending in U+FFFD is
    held back, since the next token may complete the multi-byte character.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []  # the window: already emitted context, then the pending tokens
        self._read = 0  # where the pending tokens start in the window
        self._prefix_text = ""  # decode of the context
        if prompt_ids:
            context = list(prompt_ids[-PROMPT_CONTEXT:])
            text = self._decode(context)
            if not text.endswith(REPLACEMENT):  # a prompt ending mid-character is no usable context
                self._ids, self._read, self._prefix_text = context, len(context), text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """The text that `token_id` makes final (often "", never half a character)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if not text.endswith(REPLACEMENT):
            return self._advance(len(self._ids), text)
        if len(self._ids) - self._read > MAX_PENDING:
            # Invalid bytes never resolve: without a boundary the window, and each step, would grow
            # without bound. A cut is safe when splitting there changes no character and at least
            # 3 characters (so 3 bytes) follow it, which decide any UTF-8 sequence open at the cut.
            # Where no cut is safe the window keeps growing: slower, never wrong.
            cut = len(self._ids) - CUT_TAIL
            head, tail = self._decode(self._ids[:cut]), self._decode(self._ids[cut:])
            if head + tail == text and len(tail) >= 3:
                return self._advance(cut, head)
        return ""

    def _advance(self, end: int, text: str) -> str:
        """Emit `text`, the window decoded up to `end`, past the context; those tokens become the context."""
        out = text[len(self._prefix_text) :]
        self._ids = self._ids[self._read :]
        self._read = end - self._read
        self._prefix_text = self._decode(self._ids[: self._read])
        return out

    def flush(self) -> str:
        """Everything still held back (an unfinished character as U+FFFD); call it once, at the end."""
        out = self._decode(self._ids)[len(self._prefix_text) :]
        self._ids, self._read, self._prefix_text = [], 0, ""
        return out


class StopStrings:
    """Cuts streamed text right before the first stop string, holding back what could still begin one.

    The first stop string is the first one complete as the text arrives: the one that ends earliest,
    and of those ending at the same character the one starting earliest. Deciding on the end lets
    generation stop as soon as a stop string is complete, and makes the output independent of how
    the text is split into increments. Empty stop strings are ignored.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.matched: str | None = None  # the stop string that ended the text, once one has
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._hold_max = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""

    def cut(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached); after a stop, always ("", True)."""
        if self.matched is not None:
            return "", True
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stops:
            start = buf.find(s)  # the first occurrence also ends first
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            self._held, self.matched = "", best[2]
            return buf[: best[1]], True
        # Hold back the longest tail that some stop string starts with; shorter tails are inside it.
        keep = next((k for k in range(min(len(buf), self._hold_max), 0, -1) if buf[-k:] in self._prefixes), 0)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, once the stream has ended without reaching a stop string."""
        out, self._held = self._held, ""
        return out


class TextStream:
    """One request's output text, from the engine's token ids: incremental decoding, then the
    request's stop strings. The one place ids become text, for `LLM`, `generate` and the server."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStrings(params.stop) if params.stop else None

    def add(self, token_id: int, stop_token: bool, last: bool) -> tuple[str, bool]:
        """(the text `token_id` makes final, whether a stop string ended it). A stop token adds no
        text; on the `last` token everything held back comes out."""
        text = "" if stop_token else self.detok.add(token_id)
        if last:
            text += self.detok.flush()
        if self.stops is None:
            return text, False
        text, hit = self.stops.cut(text)
        if last and not hit:
            text += self.stops.flush()
        return text, hit

    def fill(self, out: StepOutput) -> bool:
        """Fill `out`'s text from its ids; True when a stop string ended the request (`out` is then
        cut after the token that completed it and finishes "stop": the caller aborts the engine's
        request, which may have made more)."""
        ids, reason, texts = out.new_token_ids, out.finish_reason, []
        hit = False
        for j, tid in enumerate(ids):
            last = j == len(ids) - 1 and reason is not None
            text, hit = self.add(tid, last and reason == "stop", last)
            texts.append(text)
            if hit:
                out.new_token_ids, out.new_logprobs = ids[: j + 1], out.new_logprobs[: j + 1]
                out.finished, out.finish_reason = True, "stop"
                break
        out.new_text = "".join(texts)
        out.token_texts = texts if len(texts) > 1 else None
        return hit

"""A request's output on its way out: committed token blocks with their draft sources (`TokenBlock`), the
incremental detokenizer every front end streams text with (`Detokenizer`: the CLI, `Decoder.stream`,
`Request.stream` and the server), and stop strings.

Stop strings: `Engine.submit(..., stop=["..."])` ends a request once the decoded text of its output holds
one of them (`StopStrings`, built by `stop_check`).

Asked after every generated token, the check decodes only the last tokens of the output, as many as hold
the longest stop string's UTF-8 bytes with room to spare, so it costs the same however long the output is.
Tokens are counted in bytes, not characters: a byte-level token may be a piece of one character (🦢 is
three tokens of SmolLM2's tokenizer), so a window sized in tokens per character would miss a stop string
of emoji or CJK text. What each token adds to the text is known from its own decoding (`token_bytes`).
"""

from __future__ import annotations

import weakref

from ..errors import GooseError
from .stats import SOURCES

SOURCE_NAMES = {code: name for name, code in SOURCES.items()}  # anything else is the target's own token: "bonus"

MAX_STOP_BYTES = 256  # UTF-8 bytes of one stop string (the window decoded per token grows with it)
# Bytes the window holds beyond the longest stop string: its first characters may differ from the whole
# text's (see StopStrings.__call__), and a stop string must lie wholly after them.
SLACK_BYTES = 12
SKIPPED_CHARS = 3  # characters at the start of a window where no stop string is looked for
SILENT_TOKENS = 64  # tokens decoding to no text (special ones) a window may hold beyond one per needed byte

_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {token id: token_bytes}


def token_bytes(tokenizer, token: int) -> int:
    """At least how many UTF-8 bytes `token` adds to the decoded text of any token sequence holding it:
    the bytes of its own decoding, each U+FFFD (a partial character, which decodes to one replacement
    character for at least one byte) counted as one. Remembered per tokenizer."""
    try:
        sizes = _BYTES.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference: nothing is remembered
        sizes = {}
    n = sizes.get(token)
    if n is None:
        text = tokenizer.decode([token], skip_special_tokens=True)
        n = sizes[token] = len(text.encode("utf-8", "surrogatepass")) - 2 * text.count("\ufffd")
    return n


def check_stop_strings(stops: list[str]) -> None:
    """GooseError unless every stop string is a non-empty string of at most MAX_STOP_BYTES UTF-8 bytes."""
    for s in stops:
        if not isinstance(s, str) or not s:
            raise GooseError(f"a stop string must be a non-empty string, got {s!r:.60}")
        try:
            size = len(s.encode("utf-8"))
        except UnicodeEncodeError:
            raise GooseError("a stop string holds a lone surrogate (not valid Unicode text)") from None
        if size > MAX_STOP_BYTES:
            raise GooseError(f"a stop string may have at most {MAX_STOP_BYTES} bytes of UTF-8 "
                             f"(MAX_STOP_BYTES), got {size}")


class StopStrings:
    """``stop(tokens) -> bool``: True once ``tokenizer.decode(tokens, skip_special_tokens=True)`` holds one of
    `stops`. Asked after every token, so a stop string it finds ends in the last token."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        if tokenizer is None:
            raise GooseError("stop strings need a tokenizer (give the Engine one, or pass stop as a callable)")
        check_stop_strings(stops)
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.need = max(len(s.encode("utf-8")) for s in stops) + SLACK_BYTES

    def __call__(self, tokens: list[int]) -> bool:
        """The window starts where the tokens before the last one add at least `need` bytes, so a stop string
        ending in the last token starts at least SLACK_BYTES + 1 bytes into it. The window's decoding differs
        from the whole text's only in its first characters: up to 3 bytes of a character begun before it, each
        a U+FFFD, or a leading space a SentencePiece decoder drops. Three characters hold at most 12 bytes, so
        looking from the window's fourth character on skips those and misses no stop string."""
        start = self.window(tokens)
        tail = self.tokenizer.decode(tokens[start:], skip_special_tokens=True)
        skip = SKIPPED_CHARS if start else 0
        return any(tail.find(s, skip) >= 0 for s in self.stops)

    def window(self, tokens: list[int]) -> int:
        """Index of the window's first token (0: the whole output): tokens before the last one adding at least
        `need` bytes, but at most `need` + SILENT_TOKENS of them (tokens that decode to no text, such as
        special ones, add none)."""
        i, covered = max(len(tokens) - 1, 0), 0
        floor = max(0, i - self.need - SILENT_TOKENS)
        while covered < self.need and i > floor:
            i -= 1
            covered += token_bytes(self.tokenizer, tokens[i])
        return i


def stop_check(stop, tokenizer):
    """`Engine.submit`'s `stop` as a ``stop(tokens) -> bool`` (None: none): a callable as it is, a string or a
    list of strings as their `StopStrings`."""
    if stop is None or callable(stop):
        return stop
    stops = [stop] if isinstance(stop, str) else list(stop)
    return StopStrings(tokenizer, stops) if stops else None


def text_decoder(tokenizer):
    """``decode(ids) -> str``: the text of token ids as every front end shows it (special tokens left out)."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class TokenBlock(list):
    """The token ids one step committed for a request (a list of them), with `sources`: each token's draft
    source code (`goose.drafting.tree`: SPINE, BRANCH, MEMORY, HEAD; anything else is the target's own token,
    the bonus one of each step). What `on_tokens` callbacks and `Request.tokens()` receive."""

    __slots__ = ("sources",)

    def __init__(self, tokens, sources=()) -> None:
        super().__init__(tokens)
        self.sources = list(sources)

    def source_name(self, i: int) -> str:
        """The draft source of token `i` by name ("spine", "branch", "memory", "head" or "bonus")."""
        return SOURCE_NAMES.get(self.sources[i], "bonus") if i < len(self.sources) else "bonus"


MAX_PENDING = 8  # tokens a Detokenizer waits on while its text ends in U+FFFD (`Detokenizer._settle`)


class Detokenizer:
    """Token ids in, text pieces out, at a cost per token that does not grow with the output.

    Only the tokens since the last whole character are decoded, beside the ones before them for context; a
    piece is held back while the text ends inside a multi-byte character or with the start of a stop string.
    With `stops`, the text ends before the first of them (OpenAI leaves the stop string out); they are looked
    for in the new text only (and a stop's length before it). `finish()` decodes the whole output once more,
    so the pieces concatenate to exactly its decoding (cut at the first stop string).
    `decode(ids) -> str`: the tokenizer's decoding (``tokenizer.decode(ids, skip_special_tokens=True)``)."""

    def __init__(self, decode, stops: list[str] | None = None) -> None:
        self.decode, self.stops = decode, list(stops or ())
        self.longest = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []
        self.shown = ""
        self.stopped = False  # a stop string was seen: nothing more is shown
        self._text = ""  # decoded text of ids[:self._read]
        self._prefix = self._read = 0  # ids[_prefix:_read]: the context decoded again beside new tokens
        self._searched = 0  # characters of _text searched for stop strings

    @classmethod
    def of(cls, tokenizer, stops: list[str] | None = None) -> "Detokenizer":
        return cls(text_decoder(tokenizer), stops)

    def feed(self, block: list[int], per_token: bool = False) -> list[tuple[str, str]]:
        """(text, draft source of its last token) pieces for the tokens of `block` (a `TokenBlock`, or a list:
        then every source is "bonus"); with `per_token`, a piece per token where one shows."""
        if not isinstance(block, TokenBlock):
            block = TokenBlock(block)
        ends = range(1, len(block) + 1) if per_token else [len(block)]
        pieces, start = [], 0
        for end in ends:
            if self.stopped:
                break
            self.ids.extend(block[start:end])
            start = end
            piece = self._advance()
            if piece:
                pieces.append((piece, block.source_name(end - 1)))
        return pieces

    def finish(self) -> str:
        """The rest of the text."""
        if self.stopped:
            return ""
        text = self.decode(self.ids)
        cut = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cut:
            text, self.stopped = text[: min(cut)], True
        if not text.startswith(self.shown):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece

    @property
    def text(self) -> str:
        """The text shown so far (all of it after `finish()`)."""
        return self.shown

    def pieces(self, blocks):
        """Text pieces for token blocks as they come, then the rest (a generator; `text` holds the whole text
        once it is exhausted)."""
        for block in blocks:
            for piece, _ in self.feed(block):
                yield piece
        tail = self.finish()
        if tail:
            yield tail

    def _advance(self) -> str:
        final = False
        before = self.decode(self.ids[self._prefix:self._read])
        now = self.decode(self.ids[self._prefix:])
        if len(now) > len(before) and now.startswith(before):
            if not now.endswith("\ufffd"):
                self._commit(before, now, len(self.ids))
            elif len(self.ids) - self._read > MAX_PENDING:
                self._settle(before, now)
        text = self._text
        if self.stops:
            start = max(0, self._searched - self.longest + 1)
            hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
            self._searched = len(text)
            if hits:
                text, final, self.stopped = text[: min(hits)], True, True
        if not final:
            text = text[: len(text) - self._holdback(text)]
        if not text.startswith(self.shown) or len(text) <= len(self.shown):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece

    def _commit(self, before: str, text: str, end: int) -> None:
        """`text` (the decoding of ids[_prefix:end]) is final: its part after `before` joins the text."""
        self._text += text[len(before):]
        self._prefix, self._read = self._read, end

    def _settle(self, before: str, now: str) -> None:
        """The text has ended in U+FFFD for over MAX_PENDING tokens: bytes that no later token can complete (a
        character spans at most 4 bytes, so at most 4 tokens). Show the text up to a token boundary at least 3
        tokens back (a character begun before it has had 4 tokens, so it is whole or never will be) whose
        decoding the whole one begins with, and wait on the rest: the window decoded per token stays bounded
        (it grew with every such token, quadratically, before)."""
        n = len(self.ids)
        for end in range(n - 3, max(self._read, n - MAX_PENDING), -1):
            text = self.decode(self.ids[self._prefix:end])
            if len(text) > len(before) and text.startswith(before) and now.startswith(text):
                self._commit(before, text, end)
                return

    def _holdback(self, text: str) -> int:
        """Length of the longest end of `text` that begins a stop string (each stop looks only at the end of
        `text` shorter than itself, and only where its first character occurs)."""
        best = 0
        for s in self.stops:
            tail = text[len(text) - min(len(s) - 1, len(text)):]
            i = tail.find(s[0])
            while i >= 0 and len(tail) - i > best:
                if s.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return best

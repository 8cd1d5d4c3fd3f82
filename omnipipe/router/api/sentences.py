"""Text that arrives in pieces, cut into what can be spoken as it completes: sentences,
or a clause of a sentence that runs long, so that a writer who never ends one still hears
speech."""

from __future__ import annotations

import re

# A sentence ends at . ! ? or an ellipsis followed by space (closing quotes and brackets
# stay with it), at a full-width stop, which needs no space, or at a line break. A match
# starts only where a run of stops does, and takes its runs whole (possessive): a long
# run of dots with no space after it costs one pass, not one per dot (4096 dots took a
# second and a half of the router's loop).
_END = re.compile(
    r"""(?<![.!?\u2026])[.!?\u2026]++["'\u201d\u2019)\]]*+\s+"""
    r"|[\u3002\uff01\uff1f\uff1b]+|\n+"
)
# A period after one of these, or after a single letter (an initial: "J. R. R.", "U.S."),
# is not a sentence's end: "Dr. Smith" is one sentence, not "Dr." and then "Smith".
ABBREVIATIONS = frozenset(
    [
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "sr",
        "jr",
        "st",
        "mt",
        "vs",
        "etc",
        "cf",
        "al",
        "approx",
        "fig",
        "vol",
        "inc",
        "ltd",
        "co",
        "corp",
        "dept",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
    ]
)
_WORD_BEFORE = re.compile(r"([\w.]+)$")
_INITIALS = re.compile(r"(?:[^\W\d_]\.)*[^\W\d_]")  # "j", "u.s", "e.g"
# Where a long sentence may be cut instead: after a clause's mark, else at a space.
_CLAUSE = re.compile(r"[,;:\u3001\uff0c\u2014]\s*")
# A sentence longer than this is spoken a clause at a time: the first audio of a long,
# unpunctuated text must not wait for its end.
MAX_SENTENCE_CHARS = 300


class SentenceSplitter:
    """Fed text as it is written; gives back each piece to speak once it is complete."""

    def __init__(self, max_chars: int = MAX_SENTENCE_CHARS) -> None:
        self.max_chars = max_chars
        self.buffer = ""

    def feed(self, text: str) -> list[str]:
        self.buffer += text
        pieces: list[str] = []
        while True:
            end = self._sentence_end()
            if end is not None and end.end() <= self.max_chars:
                cut = end.end()
            elif len(self.buffer) > self.max_chars:
                cut = self._clause_end(self.buffer[: self.max_chars])
            else:
                break
            piece, self.buffer = self.buffer[:cut].strip(), self.buffer[cut:]
            if piece:
                pieces.append(piece)
        return pieces

    def _sentence_end(self) -> re.Match[str] | None:
        """The first end of a sentence in the buffer, past the periods of abbreviations
        and initials; only those within max_chars are looked at."""
        for end in _END.finditer(self.buffer, 0, self.max_chars + 1):
            if end.group().rstrip() != "." or not self._abbreviated(end.start()):
                return end
        return None

    def _abbreviated(self, period: int) -> bool:
        word = _WORD_BEFORE.search(self.buffer, max(0, period - 16), period)
        if word is None:
            return False
        name = word.group(1).lower()
        return name in ABBREVIATIONS or _INITIALS.fullmatch(name) is not None

    def flush(self) -> list[str]:
        """What is left, once the writer says the text is complete."""
        rest, self.buffer = self.buffer.strip(), ""
        return [rest] if rest else []

    def clear(self) -> None:
        self.buffer = ""

    @staticmethod
    def _clause_end(head: str) -> int:
        """Where to cut a head of max_chars that holds no sentence end: after its last
        clause mark, else its last space, else (one long word) at its end."""
        clauses = list(_CLAUSE.finditer(head))
        if clauses:
            return clauses[-1].end()
        space = head.rfind(" ")
        return space + 1 if space > 0 else len(head)

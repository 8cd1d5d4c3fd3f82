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
            end = _END.search(self.buffer)
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

"""Case markers: text lowercased, its capitals kept as marker characters that give them back.

A tokenizer trained on such text spends its pieces on words, not on their capitalized
forms ("The", "the", "THE" become one piece with or without a marker). Three markers from
Unicode's private use area, characters the tokenizer learns as any other:

- TITLE before a word whose first letter is a capital: "Paris" -> TITLE "paris";
- ALLCAPS before a word of two or more letters, all capitals: "NASA" -> ALLCAPS "nasa";
- CAPNEXT before any other capital inside a word: "iPhone" -> "i" CAPNEXT "phone".

A word is a run of letters (`[^\\W\\d_]`). TITLE and ALLCAPS stand before the whitespace
that precedes the word ("a" TITLE " paris"), so the word keeps its '▁' piece and the marker
joins the end of what comes before (". The" becomes the pieces "." TITLE and "▁the"); at the
start of a text they follow the whitespace, as the tokenizer drops leading whitespace. A
word whose capitals would not come back exactly (a capital whose lower case is another
length, such as 'İ') is left as it is.

The tokenizer decides: a SentencePiece model that holds SIGNATURE as a control symbol
encodes `encode_case(text)` and decodes through `decode_case` (`tokenizer.TextCodec`). Bits per byte still count
the original text's bytes: a piece counts its bytes less its markers' (`marker_bytes`,
`tokenizer.build_byte_tables`), and lower case has the capitals' UTF-8 length wherever a
marker is written. The one change that does not come back: the three private-use
characters, where a text holds them, become STAND_IN, of the same three bytes (an escape
would count bytes where it stands for a character and none where it stands for a marker).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tokenizer's module loads it; this one stays light for the command line
    import sentencepiece as spm

TITLE, ALLCAPS, CAPNEXT = "\ue001", "\ue002", "\ue003"
MARKERS = (TITLE, ALLCAPS, CAPNEXT)
# For a marker found in the text itself: another private-use character of three bytes, which
# the tokenizer's normalization keeps (it drops U+FFFD).
STAND_IN = "\ue000"

_WORD = re.compile(r"(\s*)([^\W\d_]+)")
_LITERAL = re.compile("[" + "".join(MARKERS) + "]")
# A text that ends in CAPNEXT (a model's output cut short) loses that marker.
_MARKED = re.compile(f"(?P<capnext>{CAPNEXT}.?)|(?P<marker>[{TITLE}{ALLCAPS}])(?P<space>\\s*)"
                     r"(?P<word>[^\W\d_]*)", re.DOTALL)
# A control symbol (never produced from text) that a tokenizer trained on marked text holds.
SIGNATURE = "<case-markers>"


def _upper(char: str) -> str:
    """The capital of one character where it is one character; the character otherwise."""
    upper = char.upper()
    return upper if len(upper) == 1 else char


def _lower(char: str) -> str:
    lower = char.lower()
    return lower if len(lower) == 1 and len(lower.encode("utf-8")) == len(char.encode("utf-8")) else char


def _decode_match(match: re.Match[str]) -> str:
    capped, marker, space, word = match.groups()
    if capped is not None:
        return _upper(capped[1:]) if len(capped) > 1 else ""
    if marker == ALLCAPS:
        return space + "".join(map(_upper, word))
    return space + (_upper(word[0]) + word[1:] if word else "")


def decode_case(text: str) -> str:
    """The text with its markers applied and removed (any text: a model's output too)."""
    return _MARKED.sub(_decode_match, text)


def _marked_word(word: str) -> tuple[str, str]:
    """(prefix marker or "", the word lowercased with CAPNEXT before its other capitals)."""
    lower = "".join(map(_lower, word))
    if len(word) >= 2 and word.isupper():
        return ALLCAPS, lower
    prefix = TITLE if word[0] != lower[0] else ""
    rest = "".join(CAPNEXT + low if char != low else char for char, low in zip(word[1:], lower[1:]))
    return prefix, lower[0] + rest


def _encode_match(match: re.Match[str]) -> str:
    space, word = match.groups()
    if not any(char.isupper() for char in word):
        return match.group(0)
    prefix, marked = _marked_word(word)
    encoded = space + prefix + marked if match.start() == 0 else prefix + space + marked
    return encoded if decode_case(encoded) == match.group(0) else match.group(0)


def encode_case(text: str) -> str:
    """The text lowercased with case markers; `decode_case` gives it back exactly (but for
    the markers' own characters, which become STAND_IN)."""
    plain = _LITERAL.sub(STAND_IN, text)
    encoded = _WORD.sub(_encode_match, plain)
    # Words are checked one by one; a text whose whole does not come back keeps its capitals.
    return encoded if decode_case(encoded) == plain else plain


def has_case_markers(sp: spm.SentencePieceProcessor) -> bool:
    """Whether the tokenizer reads case-marked text: it holds SIGNATURE as a control symbol."""
    token = sp.piece_to_id(SIGNATURE)
    return token != sp.unk_id() and sp.is_control(token)


def marker_bytes(piece: str) -> int:
    """The UTF-8 bytes of the markers in a piece, which stand for no byte of the text."""
    return sum(len(marker.encode("utf-8")) * piece.count(marker) for marker in MARKERS)

"""What `prepare` may change in the tokenizer recipe (`tokenizer.TRAINER_RECIPE`) when it
trains a tokenizer; imports nothing heavy, so the command line reads it at once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .case_ops import MARKERS, SIGNATURE

DEFAULT_TRAIN_SAMPLE_BYTES = 4_000_000  # the text a tokenizer learns from, from the first documents


@dataclass(frozen=True)
class TokenizerOptions:
    """What `prepare` may change in the recipe when it trains a tokenizer (the defaults are
    the recipe's)."""

    case_markers: bool = False  # train on text lowercased with case markers (`case_ops`)
    split_scripts: bool = True  # SentencePiece's split_by_unicode_script: no piece spans two scripts
    split_words: bool = True  # SentencePiece's split_by_whitespace: no piece spans two words

    def trainer_settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = {} if self.split_scripts else {"split_by_unicode_script": False}
        if not self.split_words:
            settings["split_by_whitespace"] = False
        if self.case_markers:  # the markers always pieces too, so that none falls to byte tokens
            settings.update(control_symbols=[SIGNATURE], required_chars="".join(MARKERS))
        return settings

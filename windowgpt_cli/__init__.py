"""windowgpt: train tiny, strong language models under a hard size budget."""

__version__ = "0.1.0"

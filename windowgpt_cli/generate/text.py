"""`windowgpt generate`: an artifact's model continuing a prompt, with the tokenizer it was
trained with (checked by sha256)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..artifacts import weights as model_io
from ..data.tokenizer import BOS_ID, load_sentencepiece, resolve_tokenizer
from ..errors import ConfigError, DataError
from ..runtime import resolve_device
from .decoding import continuation, generate


def find_tokenizer(artifact: Path, data_dir: Path | None, tokenizer: Path | None) -> Path:
    """--tokenizer, else DATA/tokenizer.model, else the tokenizer the artifact's run was trained with."""
    found = resolve_tokenizer(data_dir, tokenizer)
    if found is None and data_dir is None:
        data = model_io.load_weights(artifact).config.data
        found = resolve_tokenizer(Path(data.data_path) if data.data_path else None,
                                  Path(data.tokenizer_path) if data.tokenizer_path else None)
    if found is None:
        where = f"{data_dir} holds no tokenizer.model" if data_dir else "the artifact's training data is not here"
        raise DataError(f"no tokenizer: {where}; pass --tokenizer MODEL or --data DIR")
    return found


def generate_text(artifact: Path, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.8,
                  top_k: int = 50, seed: int = 0, data_dir: Path | None = None, tokenizer: Path | None = None,
                  device: str = "auto", use_cache: bool = True) -> dict[str, Any]:
    """Load the artifact's model, check its tokenizer, continue the prompt; returns what --json prints."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    if temperature < 0 or top_k < 0:
        raise ConfigError("--temperature and --top-k must not be negative")
    tokenizer_path = find_tokenizer(Path(artifact), data_dir, tokenizer)
    dev = resolve_device(device)
    weights, model = model_io.build_model(Path(artifact), dev)
    model_io.check_tokenizer(weights, tokenizer_path, artifact)
    # sdpa: --no-kv-cache runs every length once, which FlexAttention would compile anew each time
    model.set_attention_backend("sdpa", dev)
    sp = load_sentencepiece(tokenizer_path)
    prompt_ids = [BOS_ID, *sp.encode(prompt)]  # every training document starts with BOS
    out = generate(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                   use_cache=use_cache, stop_token=BOS_ID)  # BOS starts the next document
    return {
        "prompt": prompt, "completion": continuation(sp, out), "prompt_tokens": len(prompt_ids),
        "new_tokens": len(out.new_tokens), "token_ids": out.new_tokens,
        "prefill_seconds": round(out.prefill_seconds, 4), "decode_seconds": round(out.decode_seconds, 4),
        "tokens_per_second": round(out.tokens_per_second, 1), "context_limit": weights.config.model.rope_train_seq_len,
        "context_restarts": out.context_restarts, "kv_cache": use_cache, "temperature": temperature,
        "top_k": top_k, "seed": seed, "device": str(dev), "artifact": str(artifact),
        "artifact_kind": weights.kind, "artifact_sha256": weights.sha256, "tokenizer": str(tokenizer_path),
    }

"""`windowgpt generate`: an artifact's model continuing a prompt, with the tokenizer it was
trained with (found where the artifact recorded it, and checked by sha256)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..artifacts import weights as model_io
from ..config import check_settings
from ..data.tokenizer import BOS_ID, TextCodec, load_text_codec
from ..runtime import out_of_memory_as_error, resolve_device, use_cpu_threads
from .decoding import OnTokens, continuation, generate


def generate_text(artifact: Path, prompt: str, *, max_new_tokens: int = 64, num_samples: int = 1,
                  temperature: float = 0.8, top_k: int = 50, seed: int = 0, data_dir: Path | None = None,
                  tokenizer: Path | None = None, device: str = "auto", use_cache: bool = True,
                  compile_step: bool | None = None, on_text: Any = None) -> dict[str, Any]:
    """Load the artifact's model and its tokenizer, continue the prompt; returns what --json
    prints. on_text(sample, text) sees each sample's new text as it is decoded.
    compile_step (default: on CUDA) compiles the decoding step."""
    check_settings(max_new_tokens=max_new_tokens, num_samples=num_samples, temperature=temperature, top_k=top_k,
                   seed=seed)
    dev = resolve_device(device)
    weights, model = model_io.build_model(Path(artifact), dev)
    use_cpu_threads(weights.config.train.cpu_threads, dev)
    tokenizer_path = model_io.find_tokenizer(weights, Path(artifact), data_dir, tokenizer)
    # sdpa: --no-kv-cache runs every length once, which FlexAttention would compile anew each time
    model.set_attention_backend("sdpa", dev)
    codec = load_text_codec(tokenizer_path)
    prompt_ids = [BOS_ID, *codec.encode(prompt)]  # every training document starts with BOS
    on_tokens = _streamed(codec, prompt_ids, num_samples, on_text) if on_text is not None else None
    with out_of_memory_as_error(dev, "generating", "ask for fewer --num-samples"):
        out = generate(model, prompt_ids, max_new_tokens, num_samples=num_samples, temperature=temperature,
                       top_k=top_k, seed=seed, use_cache=use_cache, stop_token=BOS_ID,  # BOS starts the next document
                       compile_step=dev.type == "cuda" if compile_step is None else compile_step, on_tokens=on_tokens)
    completions = [continuation(codec, prompt_ids, sample) for sample in out.samples]
    return {
        "prompt": prompt, "completion": completions[0], "completions": completions, "samples": num_samples,
        "prompt_tokens": len(prompt_ids), "new_tokens": len(out.new_tokens), "token_ids": out.new_tokens,
        "tokens": sum(len(sample) for sample in out.samples),
        "first_token_seconds": round(out.prefill_seconds, 4), "prefill_seconds": round(out.prefill_seconds, 4),
        "first_call_seconds": round(out.first_call_seconds, 4), "decode_seconds": round(out.decode_seconds, 4),
        "tokens_per_second": round(out.tokens_per_second, 1),
        "context_limit": weights.config.model.rope_train_seq_len, "context_restarts": out.context_restarts,
        "kv_cache": use_cache, "temperature": temperature, "top_k": top_k, "seed": seed, "device": str(dev),
        "artifact": str(artifact), "artifact_kind": weights.kind, "artifact_sha256": weights.sha256,
        "tokenizer": str(tokenizer_path),
    }


def _streamed(codec: TextCodec, prompt_ids: list[int], num_samples: int, on_text) -> OnTokens:
    """on_tokens for the decoder: each sample's text decoded so far, its new part handed on
    (whole pieces only: a byte-fallback character appears once all its bytes have come)."""
    shown = [""] * num_samples

    def on_tokens(samples: list[list[int]]) -> None:
        for i, sample in enumerate(samples):
            text = continuation(codec, prompt_ids, sample)
            if text.startswith(shown[i]) and len(text) > len(shown[i]) and not text.endswith("\ufffd"):
                on_text(i, text[len(shown[i]):])
                shown[i] = text

    return on_tokens

"""`windowgpt generate`: continue a prompt with a run's, an export's or a `.ptz`'s model."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..cli_support import console, user_errors_exit_1
from ..errors import ConfigError, DataError
from .evaluate import ArtifactArg, DeviceOption, JsonOption, load_model


def find_tokenizer(artifact: Path, data_dir: Path | None, tokenizer: Path | None) -> Path:
    """--tokenizer, else DATA/tokenizer.model, else the tokenizer the artifact's run was trained with."""
    from ..model_io import load_weights
    from ..tokenizer import resolve_tokenizer

    found = resolve_tokenizer(data_dir, tokenizer)
    if found is None and data_dir is None:
        data = load_weights(artifact).config.data
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
    # torch is imported only when a command runs, so that --help answers at once
    from ..distributed import DistContext
    from ..generation import continuation, generate
    from ..runtime import resolve_device
    from ..tokenizer import BOS_ID, load_sentencepiece

    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    if temperature < 0 or top_k < 0:
        raise ConfigError("--temperature and --top-k must not be negative")
    tokenizer_path = find_tokenizer(Path(artifact), data_dir, tokenizer)
    ctx = DistContext(0, 1, 0, resolve_device(device))
    # sdpa: --no-kv-cache runs every length once, which FlexAttention would compile anew each time
    inputs = load_model(Path(artifact), tokenizer_path, ctx, "sdpa")
    sp = load_sentencepiece(inputs.tokenizer)
    prompt_ids = [BOS_ID, *sp.encode(prompt)]  # every training document starts with BOS
    out = generate(inputs.model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                   use_cache=use_cache, stop_token=BOS_ID)  # BOS starts the next document
    return {
        "prompt": prompt, "completion": continuation(sp, out), "prompt_tokens": len(prompt_ids),
        "new_tokens": len(out.new_tokens), "token_ids": out.new_tokens,
        "prefill_seconds": round(out.prefill_seconds, 4), "decode_seconds": round(out.decode_seconds, 4),
        "tokens_per_second": round(out.tokens_per_second, 1), "context_limit": inputs.config.model.rope_train_seq_len,
        "context_restarts": out.context_restarts, "kv_cache": use_cache, "temperature": temperature,
        "top_k": top_k, "seed": seed, "device": str(ctx.device), "artifact": str(artifact),
        "artifact_kind": inputs.weights.kind, "artifact_sha256": inputs.weights.sha256,
        "tokenizer": str(inputs.tokenizer),
    }


@user_errors_exit_1
def command(
    artifact: ArtifactArg,
    prompt: Annotated[str, typer.Option("--prompt", help="The text to continue (empty: a document's start).")] = "",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Tokens to generate at most "
                              "(generation also stops at the start of a new document).")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature; 0 is greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the K likeliest tokens; 0: all.")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampler (same seed, same text).")] = 0,
    data: Annotated[Optional[Path], typer.Option("--data", help="A data directory holding tokenizer.model "
                    "(default: the tokenizer the run was trained with).", show_default=False)] = None,
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help="SentencePiece model (default: "
                         "DATA/tokenizer.model, else the run's).", show_default=False)] = None,
    device: DeviceOption = "auto",
    kv_cache: Annotated[bool, typer.Option("--kv-cache/--no-kv-cache", help="Decode with the key/value cache; "
                        "--no-kv-cache recomputes the whole context for every token (same text, slower).")] = True,
    as_json: JsonOption = False,
) -> None:
    """Continue a prompt. The context is capped at the model's trained length; longer text keeps its latest tokens."""
    record = generate_text(artifact, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                           seed=seed, data_dir=data, tokenizer=tokenizer, device=device, use_cache=kv_cache)
    if as_json:
        typer.echo(json.dumps(record, indent=2))
        return
    console.print(f"[bold]{prompt}[/]{record['completion']}", highlight=False, soft_wrap=True)
    console.print(f"[dim]{record['new_tokens']} tokens, {record['tokens_per_second']:,.1f} tokens/s after a "
                  f"{record['prefill_seconds'] * 1000:.0f} ms prefill of {record['prompt_tokens']} tokens on "
                  f"{record['device']} ({'kv cache' if kv_cache else 'recomputed'})[/]", highlight=False)

"""`windowgpt generate`: continue a prompt with a run's, an export's or a `.ptz`'s model."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from .evaluate import ArtifactArg, DeviceOption, JsonOption
from .support import console, user_errors_exit_1


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
    from ..generate.text import generate_text  # imports torch: only when the command runs

    record = generate_text(artifact, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                           seed=seed, data_dir=data, tokenizer=tokenizer, device=device, use_cache=kv_cache)
    if as_json:
        typer.echo(json.dumps(record, indent=2))
        return
    console.print(f"[bold]{prompt}[/]{record['completion']}", highlight=False, soft_wrap=True)
    console.print(f"[dim]{record['new_tokens']} tokens, {record['tokens_per_second']:,.1f} tokens/s after a "
                  f"{record['prefill_seconds'] * 1000:.0f} ms prefill of {record['prompt_tokens']} tokens on "
                  f"{record['device']} ({'kv cache' if kv_cache else 'recomputed'})[/]", highlight=False)

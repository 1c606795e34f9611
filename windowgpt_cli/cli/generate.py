"""`windowgpt generate`: continue a prompt with a run's, an export's or a `.ptz`'s model
(`generate.text`), the text streamed as it is decoded."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.text import Text

from .evaluate import ArtifactArg, DeviceOption, JsonOption
from .support import console, err_console, option_help, user_errors_exit_1


@user_errors_exit_1
def command(
    artifact: ArtifactArg,
    prompt: Annotated[str, typer.Option("--prompt", help="The text to continue (empty: a document's start).")] = "",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Tokens to generate at most per sample "
                              "(a sample also stops at the start of a new document).")] = 64,
    num_samples: Annotated[int, typer.Option("--num-samples", help="Independent samples, decoded together as "
                           "one batch.")] = 1,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature; 0 is greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the K likeliest tokens; 0: all.")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampler: the same seed gives each sample the "
                    "same text, in any batch.")] = 0,
    data: Annotated[Optional[Path], typer.Option("--data", help="A data directory holding the tokenizer "
                    "(default: where the artifact recorded it).", show_default=False)] = None,
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help="SentencePiece model (default: "
                         "DATA/tokenizer.model, else where the artifact recorded it).", show_default=False)] = None,
    device: DeviceOption = "auto",
    kv_cache: Annotated[bool, typer.Option("--kv-cache/--no-kv-cache", help="Decode over the key/value buffers; "
                        "--no-kv-cache recomputes the whole context for every token (same text, slower).")] = True,
    compile_step: Annotated[Optional[bool], typer.Option("--compile/--no-compile", help=option_help(
        "Compile the decoding step: its first call takes longer (on a CPU about a minute), the others "
        "much less.", "on CUDA"),
        show_default=False)] = None,
    as_json: JsonOption = False,
) -> None:
    """Continue a prompt. The context is capped at the model's trained length; longer text keeps its latest tokens.

    Example: windowgpt generate demo-out/model.ptz --prompt "It was a dark night" --temperature 0
    """
    from ..generate.text import generate_text  # imports torch: only when the command runs

    stream = not as_json and num_samples == 1 and console.is_terminal
    if stream:
        console.print(Text(prompt, style="bold"), end="", soft_wrap=True)
    record = generate_text(artifact, prompt, max_new_tokens=max_new_tokens, num_samples=num_samples,
                           temperature=temperature, top_k=top_k, seed=seed, data_dir=data, tokenizer=tokenizer,
                           device=device, use_cache=kv_cache, compile_step=compile_step,
                           on_text=(lambda sample, text: console.print(text, end="", soft_wrap=True))
                           if stream else None)
    if as_json:
        typer.echo(json.dumps(record, indent=2))
        return
    if stream:
        console.print()
    else:  # Text objects: a prompt or a continuation holding "[" is text, never markup
        for i, completion in enumerate(record["completions"]):
            label = [Text(f"[sample {i}] ", style="dim")] if num_samples > 1 else []
            console.print(Text.assemble(*label, (prompt, "bold"), completion), highlight=False, soft_wrap=True)
    err_console.print(Text(_speed_line(record, kv_cache), style="dim"), highlight=False, soft_wrap=True)


def _speed_line(record: dict[str, Any], kv_cache: bool) -> str:
    first_call = (f", warm-up steps {record['first_call_seconds']:.1f} s (compilation, capture)"
                  if record["first_call_seconds"] else "")
    return (f"{record['tokens']} tokens in {record['samples']} sample(s), {record['tokens_per_second']:,.1f} tokens/s; "
            f"first token after {record['first_token_seconds'] * 1000:.0f} ms (prompt of {record['prompt_tokens']} "
            f"tokens){first_call}, on {record['device']} ({'static key/value buffers' if kv_cache else 'recomputed'})")

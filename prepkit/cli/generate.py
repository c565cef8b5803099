"""``prepkit generate``: text from a prepared folder, streamed as it is decoded."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from prepkit import console
from prepkit.cli._app import cli
from prepkit.cli._options import json_option, quiet_option
from prepkit.cli._run_options import as_ranks, prepared_argument, run_options


@cli.command()
@prepared_argument
@click.option("--prompt", "-p", "prompts", multiple=True, help="Prompt text; repeat for a batch. Default: stdin.")
@click.option("--chat", is_flag=True, help="Apply the folder's chat template (messages: --prompt, or JSON on stdin).")
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max-len", type=click.IntRange(min=2), help="KV cache length.  [default: prompt + new tokens]")
@click.option("--temperature", type=float, help="Sampling temperature; 0 is greedy.  [default: generation config]")
@click.option("--top-p", type=float, help="Keep the most likely tokens up to this probability mass, in (0, 1].")
@click.option("--top-k", type=int, help="Keep the k most likely tokens; 0 keeps all.  [default: generation config]")
@click.option(
    "--seed", type=click.IntRange(min=0, max=2**32 - 1), help="Seed of the sampled draws (same seed, same text)."
)
@click.option("--greedy", is_flag=True, help="Always take the most likely token.")
@click.option("--stop", multiple=True, help="End a row's text before this string; repeatable.")
@run_options
@json_option
@quiet_option
def generate(
    prepared: Path,
    prompts: tuple[str, ...],
    chat: bool,
    max_new_tokens: int,
    max_len: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    greedy: bool,
    stop: tuple[str, ...],
    activations: str,
    device: str,
    step: str | None,
    nproc: int,
    as_json: bool,
    quiet: bool,
) -> None:
    """Generate text from a prepared folder, streaming it to stdout.

    The folder is a `prepkit prepare --layout triton-moe --tp 1` set; its
    tokenizer, chat template and generation config (sampling defaults, EOS)
    come with it. Each decode step runs as one CUDA graph replay, sampling
    included. A one-line summary (prompt and new tokens, prefill and decode
    tok/s, the seed) goes to stderr; --json prints one object instead.

    \b
    Example:
        prepkit generate prepared/gpt-oss-120b-triton-moe-tp1 --chat -p "Why is the sky blue?"
        prepkit generate FOLDER -p "Once upon a time" -n 64 --temperature 0.7 --seed 1
        echo '[{"role": "user", "content": "Hi"}]' | prepkit generate FOLDER --chat --json
    """
    code = as_ranks(nproc)
    if code is not None:
        click.get_current_context().exit(code)
    from prepkit.generation.run import GenerateRequest, generate_text

    stdin_text = None if prompts else _read_stdin()
    request = GenerateRequest(
        folder=prepared, prompts=prompts, stdin_text=stdin_text, chat=chat, max_new_tokens=max_new_tokens,
        max_len=max_len, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop=stop, activations=activations, device=device, step=step,  # type: ignore[arg-type]
    )  # fmt: skip
    streamed = not as_json and len(prompts) <= 1
    result = generate_text(request, write=_write_stdout if streamed else None)
    if as_json:
        console.emit_json(result.as_dict())
        return
    if streamed:
        _write_stdout("\n")
    else:
        for index, text in enumerate(result.texts):
            click.echo(f"--- {index + 1}\n{text}")
    console.info(result.summary(), label="generate:")


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _read_stdin() -> str | None:
    if sys.stdin is None or sys.stdin.isatty():
        return None
    return sys.stdin.read()

"""``prepkit generate`` end to end on a tiny prepared folder (the Triton interpreter on the CPU):
the streamed text and the summary, --json, seeds, batches, and one clear error per bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from tests.integrations.test_transformers import _prepare

from .conftest import DEVICE

PROMPT = "w1 w2 w3 w4 w5"


def run(*args: str, input: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["generate", *args, "--device", DEVICE], input=input)
    return result.exit_code, result.stdout, result.stderr


def test_text_streams_to_stdout_and_the_summary_to_stderr(tiny_prepared: Path) -> None:
    code, out, err = run(str(tiny_prepared), "-p", PROMPT, "-n", "6", "--seed", "3")
    assert code == 0, err
    assert out.endswith("\n") and out.strip()
    assert "prompt 5 tokens" in err and "decode" in err and "tok/s" in err and "seed 3" in err
    code, as_json, err = run(str(tiny_prepared), "-p", PROMPT, "-n", "6", "--seed", "3", "--json")
    assert code == 0, err
    report = json.loads(as_json)
    # The JSON's text is what was streamed, token by token, in order.
    assert report["texts"] == [out[:-1]]
    assert report["prompt_tokens"] == 5 and 1 <= report["new_tokens"] <= 6
    assert report["seed"] == 3 and report["finish"][0] in ("eos", "length", "stop")
    assert {"prefill_tok_s", "decode_tok_s", "load_s", "first_step_s", "sampling", "device"} <= set(report)
    assert report["ranks"] == {"tp": 1, "ep": 1, "all_reduce": None}
    assert " ep1" not in err  # one rank: no split in the summary


def test_a_seed_repeats_a_run_and_greedy_ignores_it(tiny_prepared: Path) -> None:
    def text(*extra: str) -> str:
        code, out, err = run(str(tiny_prepared), "-p", PROMPT, "-n", "8", "--json", "--temperature", "3", *extra)
        assert code == 0, err
        return json.loads(out)["texts"][0]

    assert text("--seed", "5") == text("--seed", "5")
    assert len({text("--seed", str(s)) for s in range(4)}) > 1
    assert text("--greedy", "--seed", "1") == text("--greedy", "--seed", "2")


def test_prompts_of_different_lengths_run_as_one_batch(tiny_prepared: Path) -> None:
    args = ("-n", "5", "--greedy", "--json")
    code, out, err = run(str(tiny_prepared), "-p", "w7", "-p", PROMPT, *args)
    assert code == 0, err
    batch = json.loads(out)["texts"]
    alone = [json.loads(run(str(tiny_prepared), "-p", p, *args)[1])["texts"][0] for p in ("w7", PROMPT)]
    assert batch == alone


def test_chat_reads_messages_from_stdin(tiny_prepared: Path) -> None:
    messages = json.dumps([{"role": "user", "content": "w3 w4"}])
    code, out, err = run(str(tiny_prepared), "--chat", "-n", "3", "--json", input=messages)
    assert code == 0, err
    # <|start|> user <|message|> w3 w4 <|end|> <|start|> assistant: the template's tokens.
    assert json.loads(out)["prompt_tokens"] >= 6


def test_a_stop_string_ends_the_text_before_it(tiny_prepared: Path) -> None:
    code, out, _ = run(str(tiny_prepared), "-p", PROMPT, "-n", "8", "--greedy", "--json")
    free = json.loads(out)["texts"][0]
    words = free.split()
    if len(words) < 3:
        pytest.skip("the greedy text ended too early to cut")
    code, out, err = run(str(tiny_prepared), "-p", PROMPT, "-n", "8", "--greedy", "--json", "--stop", words[2])
    assert code == 0, err
    report = json.loads(out)
    assert report["texts"][0] == free[: free.index(words[2])]
    assert report["finish"] == ["stop"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--top-p", "0"), "top-p"),
        (("--temperature", "-1"), "temperature"),
        (("--max-len", "4"), "--max-len is 4"),
    ],
)
def test_bad_values_fail_before_loading(tiny_prepared: Path, args: tuple[str, ...], message: str) -> None:
    code, out, err = run(str(tiny_prepared), "-p", PROMPT, *args)
    assert code == 3 and message in err and "Traceback" not in err + out


def test_bad_folders_are_named(tiny_prepared: Path, tiny_source: Path, tmp_path: Path) -> None:
    code, _, err = run(str(tiny_source), "-p", PROMPT)
    assert code == 3 and "not a prepared folder" in err
    other = _prepare(tiny_source, tmp_path / "trt", "--layout", "trtllm-gen")
    code, _, err = run(str(other), "-p", PROMPT)
    assert code == 3 and "runtime reads" in err and "--layout triton-moe" in err
    bare = tmp_path / "bare"
    shutil.copytree(tiny_prepared, bare, symlinks=True)
    (bare / "chat_template.jinja").unlink()
    code, _, err = run(str(bare), "--chat", "-p", PROMPT)
    assert code == 3 and "no chat template" in err
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    code, _, err = run(str(bare), "-p", PROMPT)
    assert code == 3 and "holds no tokenizer" in err

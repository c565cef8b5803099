"""The pieces of a launch that need no second process: the environment, ``--nproc``'s command
and exit code, each rank's share of the dense weights, its device."""

from __future__ import annotations

import pytest
import torch

from prepkit.distributed.dense_split import DenseSplit
from prepkit.distributed.group import device_for
from prepkit.distributed.launch_env import LaunchEnv, one_host
from prepkit.distributed.spawn import exit_code_of, rank_environ, without_nproc
from prepkit.errors import LaunchError, LayoutError

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_the_environment_of_a_launch() -> None:
    env = LaunchEnv.from_environ(TORCHRUN)
    assert env == LaunchEnv(1, 2, 1, "10.0.0.1", 29500)
    assert env is not None and not env.is_main
    assert LaunchEnv.from_environ({}) is None
    assert LaunchEnv.from_environ({**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0"}) is None  # one process
    # symmetric memory only where every rank is on this host
    assert one_host({**TORCHRUN, "LOCAL_WORLD_SIZE": "2"}) and not one_host({**TORCHRUN, "LOCAL_WORLD_SIZE": "1"})
    assert not one_host(TORCHRUN)
    with pytest.raises(LaunchError, match="RANK=2 is outside the world of WORLD_SIZE=2"):
        LaunchEnv.from_environ({**TORCHRUN, "RANK": "2"})
    with pytest.raises(LaunchError, match="MASTER_PORT='x' is not a whole number"):
        LaunchEnv.from_environ({**TORCHRUN, "MASTER_PORT": "x"})
    with pytest.raises(LaunchError, match="MASTER_ADDR not set"):
        LaunchEnv.from_environ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"})


def test_nproc_runs_the_command_without_itself_as_every_rank() -> None:
    argv = ["generate", "F", "--nproc", "2", "-p", "hi", "--nproc=2", "--device", "cpu"]
    assert without_nproc(argv) == ["generate", "F", "-p", "hi", "--device", "cpu"]
    env = rank_environ({"PATH": "/bin"}, 1, 2, 1234)
    assert LaunchEnv.from_environ(env) == LaunchEnv(1, 2, 1, "127.0.0.1", 1234)
    assert exit_code_of([0, 0]) == 0
    assert exit_code_of([0, 3]) == 3  # a rank's own code wins over the others' signals
    assert exit_code_of([-15, 3]) == 3
    assert exit_code_of([-9, -15]) == 1


class Config:
    num_attention_heads, num_key_value_heads, head_dim, hidden_size, vocab_size = 8, 2, 4, 16, 12


def test_each_rank_holds_its_heads_and_vocabulary_rows() -> None:
    one, two = DenseSplit.of(Config, 2, 0), DenseSplit.of(Config, 2, 1)
    attn = "model.layers.0.self_attn."
    assert two.placement(attn + "q_proj.weight") == ("rows", 16, 32)  # 4 of 8 heads x head dim 4
    assert two.placement(attn + "q_proj.bias") == ("rows", 16, 32)
    assert two.placement(attn + "k_proj.weight") == ("rows", 4, 8)  # 1 of 2 kv heads
    assert two.placement(attn + "v_proj.bias") == ("rows", 4, 8)
    assert two.placement(attn + "o_proj.weight") == ("cols", 16, 32)
    assert two.placement(attn + "sinks") == ("rows", 4, 8)
    assert (one.placement(attn + "o_proj.bias"), two.placement(attn + "o_proj.bias")) == (
        ("rank0", 0, 0),
        ("none", 0, 0),
    )  # the bias after the sum is added once
    assert two.placement("lm_head.weight") == ("rows", 6, 12)
    for whole in ("model.embed_tokens.weight", "model.layers.0.mlp.router.weight", "model.norm.weight"):
        assert two.placement(whole) == ("whole", 0, 0)


def test_heads_that_do_not_divide_are_refused() -> None:
    with pytest.raises(LayoutError, match="num_key_value_heads: 2 does not divide among 4 ranks"):
        DenseSplit.of(Config, 4, 0)

    class OddVocab(Config):
        vocab_size = 13

    with pytest.raises(LayoutError, match="vocab_size: 13 does not divide among 2 ranks"):
        DenseSplit.of(OddVocab, 2, 0)


def test_each_rank_takes_the_gpu_of_its_local_rank() -> None:
    env = LaunchEnv(1, 2, 1, "a", 1)
    assert device_for(env, "cuda") == torch.device("cuda", 1)
    assert device_for(env, "cpu") == torch.device("cpu")
    with pytest.raises(LaunchError, match="'cuda:0' names one GPU for all 2 ranks"):
        device_for(env, "cuda:0")

"""PrepkitDecoder beyond one greedy row: left-padded batches of different lengths, EOS ending a
row, stop checks, streaming order and sampling inside the step, against transformers' own
``generate`` on the same model (transformers' MoE modules: the step's code is the same)."""

from __future__ import annotations

import pytest
import torch

from prepkit.generation.sampling import SamplingParams
from prepkit.integrations.decode_loop import left_padding
from prepkit.integrations.static_decode import PrepkitDecoder
from prepkit.synth import write_synthetic_checkpoint

from .test_transformers import TINY, load_reference

LENGTHS = (9, 4, 13)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    src = write_synthetic_checkpoint(tmp_path_factory.mktemp("rows") / "model", seed=21, **TINY)
    return load_reference(src)


def _left_padded(lengths: tuple[int, ...], pad_id: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(0, TINY["vocab_size"] - 8, (length,), generator=g)
        mask[row, width - length :] = 1
    return ids, mask


def test_left_padded_rows_decode_as_transformers_does(model: torch.nn.Module) -> None:
    model.generation_config.eos_token_id = None
    ids, mask = _left_padded(LENGTHS, pad_id=0)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    got = PrepkitDecoder(model, 32, batch_size=3).generate(ids, 10, attention_mask=mask)
    assert torch.equal(got, want)
    # Each row alone, unpadded, gives the same tokens: the padding is invisible.
    for row, length in enumerate(LENGTHS):
        alone = PrepkitDecoder(model, 32).generate(ids[row : row + 1, -length:], 10)
        assert torch.equal(alone[0, length:], got[row, ids.shape[1] :])


def test_a_row_ends_at_its_eos_and_the_others_go_on(model: torch.nn.Module) -> None:
    model.generation_config.eos_token_id = None
    ids, mask = _left_padded(LENGTHS, pad_id=0)
    free = PrepkitDecoder(model, 40, batch_size=3).generate(ids, 12, attention_mask=mask)
    eos = int(free[1, ids.shape[1] + 2])  # row 1's third new token becomes its EOS
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 1
    try:
        with torch.no_grad():
            want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        got = PrepkitDecoder(model, 40, batch_size=3).generate(ids, 12, attention_mask=mask)
    finally:
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = None
    assert torch.equal(got, want)
    assert (got[1, ids.shape[1] + 3 :] == 1).all()


def test_a_stop_check_ends_a_row_and_streaming_sees_every_token_in_order(model: torch.nn.Module) -> None:
    model.generation_config.eos_token_id = None
    ids, mask = _left_padded(LENGTHS, pad_id=0)
    seen: list[torch.Tensor] = []

    class Streamer:
        ended = False

        def put(self, value: torch.Tensor) -> None:
            seen.append(value.clone())

        def end(self) -> None:
            self.ended = True

    streamer = Streamer()
    calls = {"n": 0}

    def stop(new: torch.Tensor) -> set[int]:
        calls["n"] += 1
        return {0} if calls["n"] == 4 else set()

    decoder = PrepkitDecoder(model, 40, batch_size=3)
    free = decoder.generate(ids, 9, attention_mask=mask)
    got = decoder.generate(ids, 9, attention_mask=mask, streamer=streamer, stop=stop)
    assert streamer.ended and torch.equal(seen[0], ids)
    streamed, width = torch.stack(seen[1:], 1), ids.shape[1]
    assert torch.equal(streamed[1:], free[1:, width:])  # every step, in order
    assert torch.equal(streamed[0, :4], free[0, width : width + 4])
    assert (streamed[0, 4:] == decoder.fill_id).all()  # the stopped row streams padding only
    assert torch.equal(got[0, : width + 4], free[0, : width + 4])
    assert torch.equal(got[1:], free[1:])
    assert decoder.stats.new_tokens == 4 + 9 + 9


def test_sampling_repeats_with_its_seed_and_follows_the_filters(model: torch.nn.Module) -> None:
    model.generation_config.eos_token_id = None
    ids, mask = _left_padded(LENGTHS, pad_id=0)
    decoder = PrepkitDecoder(model, 40, batch_size=3)
    params = SamplingParams(greedy=False, temperature=1.5, top_k=3, top_p=1.0)
    a = decoder.generate(ids, 12, attention_mask=mask, sampling=params, seed=11)
    b = decoder.generate(ids, 12, attention_mask=mask, sampling=params, seed=11)
    c = decoder.generate(ids, 12, attention_mask=mask, sampling=params, seed=12)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = decoder.generate(ids, 12, attention_mask=mask)
    assert not torch.equal(a, greedy)
    # Teacher-forced: each sampled token is among the top 3 of transformers' logits there.
    with torch.no_grad():
        full_mask = torch.cat([mask, torch.ones(3, 12, dtype=torch.long)], 1)
        logits = model(a, attention_mask=full_mask).logits
    width = ids.shape[1]
    top3 = logits[:, width - 1 : -1].topk(3, dim=-1).indices
    assert (top3 == a[:, width:, None]).any(-1).all()


def test_left_padding_reads_the_mask_and_refuses_others() -> None:
    assert left_padding(torch.tensor([[0, 0, 1], [1, 1, 1]]), 2, 3).tolist() == [2, 0]
    with pytest.raises(ValueError, match="left"):
        left_padding(torch.tensor([[1, 0, 1]]), 1, 3)
    with pytest.raises(ValueError, match="without any token"):
        left_padding(torch.tensor([[0, 0]]), 1, 2)


def test_the_decode_loop_never_reads_a_device_tensor(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU each such read syncs the host with the step in flight and undoes the pipelining;
    # on the CPU, count the scalar reads the loop makes of the decoder's state tensors.
    decoder = PrepkitDecoder(model, 40, batch_size=3)
    ids, mask = _left_padded(LENGTHS, pad_id=0)
    decoder.generate(ids, 3, attention_mask=mask)
    state = {id(t) for t in (decoder.fill_id, decoder.eos_ids, decoder.position, decoder.seed, decoder.finished)}
    reads: list[str] = []
    for name in ("__int__", "item", "tolist"):
        original = getattr(torch.Tensor, name)

        def spy(self: torch.Tensor, *a: object, _name: str = name, _orig: object = original) -> object:
            if id(self) in state:
                reads.append(_name)
            return _orig(self, *a)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, name, spy)
    decoder.generate(ids, 6, attention_mask=mask)
    assert reads == []

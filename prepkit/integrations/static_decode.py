"""Decoding a transformers gpt-oss model with every piece of state on the device, so that one
decode step (embedding -> all decoder layers -> final norm -> lm_head -> greedy or sampled choice
-> next input and position) is captured in one CUDA graph and replayed once per token.

transformers' own caches keep part of their bookkeeping on the host (a plain capture of a
``StaticCache`` step replays out of bounds), so this module brings its own: a static KV cache per
layer, ``[batch, kv_heads, max_len, head_dim]``, written at a device-side position, and causal /
sliding-window masks computed from that position on the device. The prompt runs through the
model's own modules (embedding, rotary embedding, norms, q/k/v/o projections, attention sinks, the
MoE block, ``lm_head``); each decode step runs :mod:`prepkit.integrations.decode_step`'s step on
the same weights (q, k and v fused into one projection), eagerly or compiled. The MoE block is
prepkit's :class:`~prepkit.integrations.transformers.PrepkitMoeBlock` for a captured step
(transformers' own expert loop syncs with the host and cannot be captured). Both follow
transformers' eager gpt-oss attention operation for operation (bf16 scores, additive mask, sink
column, softmax in the scores' dtype), so the tokens are ``model.generate(do_sample=False)``'s: on
the CPU exactly; on a GPU up to near ties between logits, since the MoE kernel's combine adds in
fp32 atomics (not bitwise deterministic) and cuBLAS reduces over the cache's full length.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from prepkit.generation.sampling import SamplingParams, sample
from prepkit.integrations import decode_ops, decode_step
from prepkit.integrations.decode_loop import (
    DecodeStats,
    Readback,
    Rows,
    StopCheck,
    TokenStreamer,
    ids_of,
    left_padding,
)

GREEDY = SamplingParams()
RECOMPILE_LIMIT = 64


class PrepkitDecoder:
    """Decoding for a transformers gpt-oss ``model`` (up to ``batch_size`` rows, prompts of any
    lengths, at most ``max_len`` tokens in all) on a static KV cache of its own.

    ``generate(input_ids, max_new_tokens, ...)`` runs the prompt eagerly (one forward over all its
    tokens), then one decode step per new token. Rows of different lengths come left-padded with
    an ``attention_mask``, as transformers takes them: a row's pad slots are masked out and its
    positions count from its first real token. Each step chooses the next token greedily or by
    sampling (:mod:`prepkit.generation.sampling`: temperature, top-k, top-p and the seed act inside
    the step), and a row that produced an EOS id gets the pad id from then on.

    With ``cuda_graph=True`` (on a CUDA device) the first decode step runs eagerly as warm-up and
    is then captured once into a ``torch.cuda.CUDAGraph`` per sampling setting; later steps, and
    later calls, replay it. The host reads each step's ids back one step behind (a pinned copy
    and an event), which feeds a streamer and stops the loop once every row has finished without
    stalling the device. It returns what ``model.generate`` returns: prompt and new tokens,
    stopped at the EOS ids (rows that finish early padded with the pad id).

    ``eos_ids`` and ``pad_id`` default to the model's generation config; ``keep_logits`` leaves
    each step's logits in ``self.logits``. The decode step takes the model's weights and MoE
    blocks as they are when the decoder is built: swap MoE blocks (``use_prepkit_moe``) first.
    The cache costs ``2 * layers * batch * kv_heads * max_len * head_dim`` elements of the
    model's dtype.

    The decode step (:class:`~prepkit.integrations.decode_step.DecodeStep`) runs eagerly by
    default: the modules' operations one for one, so its tokens are ``generate``'s.
    ``compile=True`` (prepkit's MoE blocks only) runs its pieces through ``torch.compile``: about
    half the time per layer (measured on an H100: 109 against 213 us at gpt-oss-120b dims), but
    the fused floating-point work rounds differently in the last bf16 bits, and where a router
    holds a near tie a token then goes to another expert: its tokens can part from ``generate``'s
    where the default step's do not. ``projections="reduction"`` writes the compiled step's bf16
    projections as fp32 multiply-and-sum reductions instead of library GEMMs (a few percent
    faster on an H100; the eager step keeps the GEMMs). ``kernels=True`` (prepkit's MoE blocks
    only) runs the layer ops as prepkit's decode kernels (:mod:`~prepkit.integrations.kernel_ops`:
    one launch each, their variants from the tactics DBs), the MoE's output kept in fp32 for the
    next op to add, and compiles only the embedding and the sampler. ``ops`` replaces the step's layer ops
    (:class:`~prepkit.integrations.decode_ops.Ops`; default: the torch ones); ``reduce`` and
    ``gather`` are the step's tensor-parallel hooks (see ``DecodeStep``); ``reduce_fp32``: ``reduce``
    takes the kernels' fp32 MoE output as it is (see ``step_of_model``).
    """

    def __init__(
        self,
        model: Any,
        max_len: int,
        *,
        batch_size: int = 1,
        cuda_graph: bool = True,
        compile: bool = False,
        kernels: bool = False,
        projections: str = "linear",
        eos_ids: Sequence[int] | None = None,
        pad_id: int | None = None,
        keep_logits: bool = False,
        ops: decode_ops.Ops | None = None,
        reduce: decode_step.Hook | None = None,
        gather: decode_step.Hook | None = None,
        reduce_fp32: bool = False,
    ) -> None:
        config = model.config
        base = model.model
        self.model = model
        self.config = config
        self.layers = list(base.layers)
        embed = base.embed_tokens.weight
        self.device, self.dtype = embed.device, embed.dtype
        self.max_len, self.batch_size = max_len, batch_size
        self.cuda_graph = cuda_graph and self.device.type == "cuda"
        attn = self.layers[0].self_attn
        shape = (batch_size, config.num_key_value_heads, max_len, attn.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.kv_index = torch.arange(max_len, device=self.device)
        # The step's whole state, at fixed addresses: the cache slot of the next input, that input,
        # each row's left padding, which rows have finished, and the sampling seed.
        long = {"dtype": torch.long, "device": self.device}
        self.position = torch.zeros((), **long)
        self.next_ids = torch.zeros(batch_size, 1, **long)
        self.pad = torch.zeros(batch_size, **long)
        self.finished = torch.zeros(batch_size, dtype=torch.bool, device=self.device)
        self.seed = torch.zeros((), **long)
        eos = list(eos_ids) if eos_ids is not None else ids_of(model.generation_config.eos_token_id)
        self._eos = eos
        self.eos_ids = torch.tensor(eos, **long)
        self.pad_id = pad_id if pad_id is not None else self._pad_id()
        # The id a finished row gets: on the device for the step, on the host for the loop (reading
        # a device scalar would sync the host with the device every step).
        self._fill = self.pad_id if self.pad_id is not None else (eos[0] if eos else 0)
        self.fill_id = torch.tensor(self._fill, **long)
        # With keep_logits each step also leaves its logits here (accuracy checks read them).
        vocab = config.vocab_size  # the whole vocabulary: a split head's logits come back gathered
        self.logits = torch.zeros(batch_size, vocab, device=self.device) if keep_logits else None
        self.sampling = GREEDY
        self.graphs: dict[SamplingParams, torch.cuda.CUDAGraph] = {}
        self.stats = DecodeStats()
        # Every decode step runs decode_step's functions (eagerly, or compiled: the work between
        # matrix products fuses); the prompt runs the model's modules (one shape per length).
        prepkit_moe = all(hasattr(layer.mlp, "moe_layer") for layer in self.layers)
        if (compile or kernels) and not prepkit_moe:
            mode = "compile=True" if compile else "kernels=True"
            raise ValueError(f"{mode} needs prepkit's MoE blocks (from_prepared or use_prepkit_moe)")
        if compile and kernels:
            raise ValueError("choose compile=True or kernels=True, not both")
        self.compiled, self.kernels = compile, kernels
        # The sampler's elementwise work (temperature, filters, the hash noise) fuses when compiled.
        self._sample = torch.compile(sample, fullgraph=True, dynamic=False) if compile or kernels else sample
        # Reductions pay off only fused: eagerly they would materialize [B, N, K] fp32 products.
        compiled_ops = decode_ops.torch_ops(projections)  # checks the name in any mode
        if kernels and ops is None:
            from prepkit.integrations.kernel_ops import kernel_ops, tuned_chooser

            ops = kernel_ops(tuned_chooser(self.device))
        step_ops = ops if ops is not None else compiled_ops if compile else decode_ops.TORCH_OPS
        if self.compiled or self.kernels:
            # One compiled graph per piece, batch size, cache length and layer form: allow a few.
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
        self.decode_step = decode_step.step_of_model(
            model, ops=step_ops, compiled=compile, kernels=kernels, reduce=reduce, gather=gather,
            reduce_fp32=reduce_fp32,
        )  # fmt: skip

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured step of the current sampling setting, once there is one."""
        return self.graphs.get(self.sampling)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        attention_mask: torch.Tensor | None = None,
        sampling: SamplingParams = GREEDY,
        seed: int = 0,
        streamer: TokenStreamer | None = None,
        stop: StopCheck | None = None,
    ) -> torch.Tensor:
        """``[batch, prompt]`` ids -> ``[batch, prompt + new]`` ids (see the class). ``batch`` may
        be below the decoder's ``batch_size`` (the spare rows decode padding, unseen).
        ``attention_mask`` (1 for tokens, 0 for left padding) as transformers takes it; ``seed``
        keys the sampled draws (the same seed repeats a run exactly); ``stop`` may end rows early.
        """
        batch, prompt = input_ids.shape
        if max_new_tokens < 1 or prompt + max_new_tokens > self.max_len:
            raise ValueError(f"prompt {prompt} + max_new_tokens {max_new_tokens} must be within max_len {self.max_len}")
        started = time.perf_counter()
        pad = self.prefill(input_ids, attention_mask=attention_mask, sampling=sampling, seed=seed)
        first = self.next_ids[:batch, 0].to("cpu", copy=True)  # one sync: ends the prefill
        stats = self.stats = DecodeStats(prompt_tokens=int(prompt * batch - int(pad.sum())))
        stats.prefill_s = time.perf_counter() - started
        if streamer is not None:
            streamer.put(input_ids.cpu())
        rows = Rows(batch, self._eos)
        self._take(first, rows, streamer, stop)
        reader = Readback(self.next_ids, batch)
        launched = 0
        if max_new_tokens > 1 and not rows.all_done():
            # The first step warms up and captures: timed apart, and synchronously.
            started = time.perf_counter()
            self.step()
            reader.launch()
            self._take(reader.collect(), rows, streamer, stop)
            launched = 1
            stats.first_step_s = time.perf_counter() - started
        started = time.perf_counter()
        while True:
            if launched < max_new_tokens - 1 and not rows.all_done():
                self.step()
                reader.launch()
                launched += 1
                if reader.in_flight() < 2:
                    continue  # keep one step ahead of the host
            if not reader.in_flight():
                break
            new = reader.collect()
            if not rows.all_done():  # steps in flight past the end are dropped
                self._take(new, rows, streamer, stop)
        if launched > 1:
            stats.decode_s = time.perf_counter() - started
            stats.decode_steps = launched - 1
        if streamer is not None:
            streamer.end()
        stats.new_tokens = rows.kept_tokens()
        return rows.result(input_ids.cpu(), self.pad_id)

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        sampling: SamplingParams = GREEDY,
        seed: int = 0,
    ) -> torch.Tensor:
        """Run the prompt (one forward over all its tokens, writing the cache) and choose each
        row's first new token, leaving the state set for the first decode step. Returns each
        row's left padding ``[batch]``."""
        batch, prompt = input_ids.shape
        if batch > self.batch_size:
            raise ValueError(f"input_ids has batch {batch}, the decoder was built for {self.batch_size}")
        if prompt >= self.max_len:
            raise ValueError(f"prompt {prompt} must be shorter than max_len {self.max_len}")
        pad = left_padding(attention_mask, batch, prompt)
        ids = torch.zeros(self.batch_size, prompt, dtype=torch.long)
        ids[:batch] = input_ids.cpu()
        self.sampling = sampling
        self.pad.zero_()
        self.pad[:batch] = pad.to(self.device)
        self.finished.zero_()
        self.seed.fill_(seed)
        logits = self.forward(ids.to(self.device), self.kv_index[:prompt])
        self.position.fill_(prompt)
        self.next_ids.copy_(self._choose(logits)[:, None])
        return pad

    def _take(self, new: torch.Tensor, rows: Rows, streamer: TokenStreamer | None, stop: StopCheck | None) -> None:
        new = rows.add(new, self._fill)
        if streamer is not None:
            streamer.put(new)
        stopped = stop(new) if stop is not None else None
        for row in stopped or ():
            rows.stop(row)
            self.finished[row] = True  # ordered after the step in flight: later steps pad it

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token ``[B]`` at the slot ``self.position``; a finished row gets the
        pad id, and a row that chose an EOS id is finished from now on."""
        if self.logits is not None:
            self.logits.copy_(logits)
        chosen = self._sample(logits, self.sampling, self.seed, self.position)
        chosen = torch.where(self.finished, self.fill_id, chosen)
        if self.eos_ids.numel():
            self.finished |= (chosen[:, None] == self.eos_ids[None, :]).any(-1)
        return chosen

    @torch.no_grad()
    def step(self) -> None:
        """One decode step from the device-side state: a graph replay once captured."""
        if not self.cuda_graph:
            self._step()
            return
        graph = self.graphs.get(self.sampling)
        if graph is not None:
            graph.replay()
            return
        # Warm-up on a side stream (Triton and torch.compile compile, cuBLAS picks its workspace):
        # this call's real step, then for compiled steps one more whose state is rolled back, so
        # that nothing compiles while the graph is being captured. Its cache writes lie past the
        # position and are written again before anything reads them.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step()
            if self.compiled or self.kernels:
                state = [t.clone() for t in (self.position, self.next_ids, self.finished)]
                self._step()
                for live, saved in zip((self.position, self.next_ids, self.finished), state, strict=True):
                    live.copy_(saved)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # Capturing runs nothing: the real step was the first warm-up.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self.graphs[self.sampling] = graph

    def _step(self) -> None:
        logits = self.decode_step(self.next_ids[:, 0], self.position, self.pad, self.keys, self.values)
        self.position.add_(1)
        self.next_ids.copy_(self._choose(logits)[:, None])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits of the last position, ``[batch, vocab]``, for ``input_ids`` ``[batch, T]`` at
        device-side cache slots ``positions`` ``[T]``, through the model's modules (the prompt);
        writes their keys and values into the cache."""
        base = self.model.model
        hidden = base.embed_tokens(input_ids)
        cos, sin = base.rotary_emb(hidden, decode_ops.token_positions(positions, self.pad))
        masks = {
            "full_attention": self._mask(positions, None),
            "sliding_attention": self._mask(positions, self.config.sliding_window),
        }
        for index, layer in enumerate(self.layers):
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            mask = masks[self.config.layer_types[index]]
            hidden = residual + self._attention(layer.self_attn, hidden, cos, sin, mask, index, positions)
            residual = hidden
            hidden, _ = layer.mlp(layer.post_attention_layernorm(hidden))
            hidden = residual + hidden
        # The norm is per token: only the last position feeds the head.
        return self.model.lm_head(base.norm(hidden[:, -1:]))[:, -1]

    def _mask(self, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """Additive ``[B, 1, T, max_len]`` mask: causal, within ``window`` for sliding layers, and
        past each row's left padding."""
        return decode_ops.additive_mask(self.kv_index, positions, window, self.dtype, self.pad)

    def _attention(
        self,
        attn: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        index: int,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape
        head_dim = attn.head_dim
        fused = getattr(attn, "qkv_proj", None)  # MX projections: q, k and v in one launch
        if fused is not None:
            kv_rows = attn.k_proj.out_features
            query, key, value = fused(x).split([fused.out_features - 2 * kv_rows, kv_rows, kv_rows], dim=-1)
        else:
            query, key, value = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        query = query.reshape(batch, tokens, -1, head_dim).transpose(1, 2)
        key = key.reshape(batch, tokens, -1, head_dim).transpose(1, 2)
        value = value.reshape(batch, tokens, -1, head_dim).transpose(1, 2)
        keys, values = self.keys[index], self.values[index]
        keys.index_copy_(2, positions, decode_ops.rotate(key, cos, sin))
        values.index_copy_(2, positions, value)
        query = decode_ops.rotate(query, cos, sin)
        return attn.o_proj(decode_ops.attend(query, keys, values, mask, attn.sinks, attn.scaling))

    def _pad_id(self) -> int | None:
        pad = self.model.generation_config.pad_token_id
        return pad if pad is not None else self.config.pad_token_id


def generate_greedy(
    model: Any, input_ids: torch.Tensor, max_new_tokens: int, *, cuda_graph: bool = True
) -> torch.Tensor:
    """One-off :class:`PrepkitDecoder` sized for this call: greedy tokens as
    ``model.generate(input_ids, max_new_tokens=..., do_sample=False)`` gives them, decoded with one
    CUDA graph per step on a CUDA device. Keep a decoder to reuse its cache and captured graph."""
    decoder = PrepkitDecoder(
        model, input_ids.shape[1] + max_new_tokens, batch_size=input_ids.shape[0], cuda_graph=cuda_graph
    )
    return decoder.generate(input_ids, max_new_tokens)

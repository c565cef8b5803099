"""Greedy decoding of a transformers gpt-oss model with every piece of state on the device, so that
one decode step (embedding -> all decoder layers -> final norm -> lm_head -> argmax -> next input
and position) is captured in one CUDA graph and replayed once per token.

transformers' own caches keep part of their bookkeeping on the host (a plain capture of a
``StaticCache`` step replays out of bounds), so this module brings its own: a static KV cache per
layer, ``[batch, kv_heads, max_len, head_dim]``, written at a device-side position, and causal /
sliding-window masks computed from that position on the device. Everything else is the model's
own modules: embedding, rotary embedding, norms, q/k/v/o projections, attention sinks, the MoE
block (prepkit's :class:`~prepkit.integrations.transformers.PrepkitMoeBlock`; transformers' own
expert loop syncs with the host and cannot be captured) and ``lm_head``. The attention follows
transformers' eager gpt-oss attention operation for operation (bf16 scores, additive mask, sink
column, softmax in the scores' dtype), so the tokens are ``model.generate(do_sample=False)``'s: on
the CPU exactly; on a GPU up to near ties between logits, since the MoE kernel's combine adds in
fp32 atomics (not bitwise deterministic) and cuBLAS reduces over the cache's full length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from prepkit.integrations import decode_step


class PrepkitDecoder:
    """Greedy decoding for a transformers gpt-oss ``model`` (batch ``batch_size``, prompts of one
    length, at most ``max_len`` tokens in all) on a static KV cache of its own.

    ``generate(input_ids, max_new_tokens)`` runs the prompt eagerly (one forward over all its
    tokens), then one decode step per new token. With ``cuda_graph=True`` (on a CUDA device) the
    first decode step runs eagerly as warm-up and is then captured once into a
    ``torch.cuda.CUDAGraph``; later steps, and later calls, replay it without any host sync; the
    tokens are read back once, at the end. It returns what ``model.generate(input_ids,
    max_new_tokens=..., do_sample=False)`` returns: prompt and new tokens, stopped at the
    generation config's EOS ids (rows that finish early padded with its pad id).

    The decode step reads the model's modules at call time, so a model whose MoE blocks were
    swapped (``use_prepkit_moe``) before the decoder was built decodes with them. The cache costs
    ``2 * layers * batch * kv_heads * max_len * head_dim`` elements of the model's dtype.

    ``compile=True`` (prepkit's MoE blocks only) runs each decode step through the compiled
    halves of :mod:`prepkit.integrations.decode_step` instead of the modules: about half the time
    per layer (measured on an H100: 109 against 213 us at gpt-oss-120b dims), but the fused
    floating-point work rounds differently in the last bf16 bits, and where a router holds a near
    tie a token then goes to another expert: its tokens can part from ``generate``'s where the
    default step's do not. The q/k/v projections are packed into one matrix then (the modules keep
    views of it). ``projections="reduction"`` writes the compiled step's projections as fp32
    multiply-and-sum reductions instead of library GEMMs (a few percent faster on an H100).
    """

    def __init__(
        self,
        model: nn.Module,
        max_len: int,
        *,
        batch_size: int = 1,
        cuda_graph: bool = True,
        compile: bool = False,
        projections: str = "linear",
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
        # The step's whole state, at fixed addresses: the position of the next input, that input,
        # and every token so far (the graph writes each new one at its position).
        self.position = torch.zeros((), dtype=torch.long, device=self.device)
        self.next_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self.tokens = torch.zeros(batch_size, max_len, dtype=torch.long, device=self.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        # Compiled decode steps fuse the work between matrix products (decode_step); by default on
        # CUDA, where launch gaps dominate a step, and never for the prompt (one shape per length).
        prepkit_moe = all(hasattr(layer.mlp, "moe_layer") for layer in self.layers)
        if compile and not prepkit_moe:
            raise ValueError("compile=True needs prepkit's MoE blocks (from_prepared or use_prepkit_moe)")
        self.compiled = compile
        if projections not in ("reduction", "linear"):
            raise ValueError(f"projections must be 'reduction' or 'linear', got {projections!r}")
        self._as_reduction = projections == "reduction"
        if self.compiled:
            self._weights = [decode_step.LayerWeights.of(layer) for layer in self.layers]
            self._lm_head = decode_step.weight_of(model.lm_head)
            self._eps = float(base.norm.variance_epsilon)
            self._embed = torch.compile(decode_step.embed, fullgraph=True, dynamic=False)
            self._attention_in = torch.compile(decode_step.attention_in, fullgraph=True, dynamic=False)
            self._attention_out = torch.compile(decode_step.attention_out, fullgraph=True, dynamic=False)
            self._head = torch.compile(decode_step.head, fullgraph=True, dynamic=False)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """``[batch, prompt]`` ids -> ``[batch, prompt + new]`` ids, greedy (see the class)."""
        batch, prompt = input_ids.shape
        if batch != self.batch_size:
            raise ValueError(f"input_ids has batch {batch}, the decoder was built for {self.batch_size}")
        if max_new_tokens < 1 or prompt + max_new_tokens > self.max_len:
            raise ValueError(f"prompt {prompt} + max_new_tokens {max_new_tokens} must be within max_len {self.max_len}")
        input_ids = input_ids.to(self.device)
        self.tokens[:, :prompt] = input_ids
        logits = self.forward(input_ids, self.kv_index[:prompt])
        self.next_ids.copy_(logits.argmax(-1, keepdim=True))
        self.position.fill_(prompt)
        self.tokens.index_copy_(1, self.position.view(1), self.next_ids)
        for _ in range(max_new_tokens - 1):
            self.step()
        out = self.tokens[:, : prompt + max_new_tokens].cpu()  # the one host sync
        return stop_at_eos(out, prompt, _ids(self.model.generation_config.eos_token_id), self._pad_id())

    @torch.no_grad()
    def step(self) -> None:
        """One greedy decode step from the device-side state: a graph replay once captured."""
        if not self.cuda_graph:
            self._step()
            return
        if self.graph is not None:
            self.graph.replay()
            return
        # Warm-up on a side stream (Triton and torch.compile compile, cuBLAS picks its workspace):
        # this call's real step, then for compiled steps one more whose state is rolled back, so
        # that nothing compiles while the graph is being captured. Its cache and token writes lie
        # past the position and are written again before anything reads them.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step()
            if self.compiled:
                position, next_ids = self.position.clone(), self.next_ids.clone()
                self._step()
                self.position.copy_(position)
                self.next_ids.copy_(next_ids)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # Capturing runs nothing: the real step was the first warm-up.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self.graph = graph

    def _step(self) -> None:
        positions = self.position.view(1)
        if self.compiled:
            self.next_ids.copy_(self._compiled_forward(positions))
        else:
            logits = self.forward(self.next_ids, positions)
            self.next_ids.copy_(logits.argmax(-1, keepdim=True))
        self.position.add_(1)
        self.tokens.index_copy_(1, self.position.view(1), self.next_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits of the last position, ``[batch, vocab]``, for ``input_ids`` ``[batch, T]`` at
        device-side ``positions`` ``[T]``; writes their keys and values into the cache."""
        base = self.model.model
        hidden = base.embed_tokens(input_ids)
        cos, sin = base.rotary_emb(hidden, positions.unsqueeze(0))
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

    def _compiled_forward(self, positions: torch.Tensor) -> torch.Tensor:
        """Greedy ids ``[batch, 1]`` after ``self.next_ids`` at ``positions`` ``[1]``, through the
        compiled halves of :mod:`prepkit.integrations.decode_step`; writes the cache."""
        from prepkit.runtime.moe import moe

        base = self.model.model
        rotary = base.rotary_emb
        hidden, cos, sin = self._embed(
            self.next_ids, base.embed_tokens.weight, positions, rotary.inv_freq, float(rotary.attention_scaling)
        )
        windows = {"full_attention": None, "sliding_attention": self.config.sliding_window}
        mlp_out = None
        for index, (layer, weights) in enumerate(zip(self.layers, self._weights, strict=True)):
            attn = layer.self_attn
            keys, values = self.keys[index], self.values[index]
            hidden, query = self._attention_in(
                hidden,
                mlp_out,
                weights,
                cos,
                sin,
                keys,
                values,
                positions,
                self._eps,
                attn.head_dim,
                self._as_reduction,
            )
            window = windows[self.config.layer_types[index]]
            hidden, x, logits = self._attention_out(
                hidden,
                query,
                keys,
                values,
                positions,
                window,
                weights,
                attn.scaling,
                self._eps,
                self._as_reduction,
            )
            mlp_out = moe(layer.mlp.moe_layer, x, logits).view(hidden.shape)
        return self._head(hidden, mlp_out, base.norm.weight, self._lm_head, self._eps)

    def _mask(self, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """Additive ``[T, max_len]`` mask: causal, and within ``window`` for sliding layers."""
        return decode_step.additive_mask(self.kv_index, positions, window, self.dtype)

    def _attention(
        self,
        attn: nn.Module,
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
        keys.index_copy_(2, positions, decode_step.rotate(key, cos, sin))
        values.index_copy_(2, positions, value)
        query = decode_step.rotate(query, cos, sin)
        return attn.o_proj(decode_step.attend(query, keys, values, mask, attn.sinks, attn.scaling))

    def _pad_id(self) -> int | None:
        pad = self.model.generation_config.pad_token_id
        return pad if pad is not None else self.config.pad_token_id


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, Sequence | torch.Tensor) else [int(value)]


def stop_at_eos(tokens: torch.Tensor, prompt: int, eos_ids: list[int], pad_id: int | None) -> torch.Tensor:
    """What greedy ``generate`` keeps of ``tokens`` ``[batch, prompt + new]``: a row's tokens after
    its first EOS become ``pad_id``, and the columns after the step where every row has finished go."""
    if not eos_ids:
        return tokens
    new = tokens[:, prompt:]
    is_eos = torch.isin(new, torch.tensor(eos_ids, dtype=new.dtype))
    finished_after = is_eos.long().cumsum(1) > 0  # at or after the first EOS
    past_eos = torch.cat([torch.zeros_like(finished_after[:, :1]), finished_after[:, :-1]], dim=1)
    if pad_id is not None:
        new = new.masked_fill(past_eos, pad_id)
    all_done = finished_after.all(0).nonzero()
    keep = int(all_done[0]) + 1 if len(all_done) else new.shape[1]
    return torch.cat([tokens[:, :prompt], new[:, :keep]], dim=1)


def generate_greedy(
    model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *, cuda_graph: bool = True
) -> torch.Tensor:
    """One-off :class:`PrepkitDecoder` sized for this call: greedy tokens as
    ``model.generate(input_ids, max_new_tokens=..., do_sample=False)`` gives them, decoded with one
    CUDA graph per step on a CUDA device. Keep a decoder to reuse its cache and captured graph."""
    decoder = PrepkitDecoder(
        model, input_ids.shape[1] + max_new_tokens, batch_size=input_ids.shape[0], cuda_graph=cuda_graph
    )
    return decoder.generate(input_ids, max_new_tokens)

"""CausalLM: token embedding -> stacked blocks run with lax.scan -> final norm -> LM head.

The architecture is GPT-2's (Radford et al., 2019) generalised by `ModelConfig` switches to
Llama (Touvron et al., 2023), Mistral, Qwen2/3, Gemma 1/2/3, Phi-3, OLMo 2, SmolLM3 and the
mixtures of experts Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE, gpt-oss, Llama 4 and DeepSeek-V2/V3 (a
sparse MoE in place of each MLP; DeepSeek's first layers and Maverick's alternate ones dense, a
second stack `dense_blocks`, and DeepSeek's attention latent).
The layers are one Block whose arrays carry a leading `layers` axis, so compile time does not
grow with depth; what differs between layers (windowed or global attention, and with it the RoPE
base; rotary or NoPE) is a per-layer flag scanned alongside the weights.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqllm.config import ModelConfig, dotted
from eqllm.config.kinds import STACKS, layer_stacks, stack_field
from eqllm.config.per_layer import kv_sources
from eqllm.nn import (
    Block,
    Embedding,
    GatedDeltaNetState,
    KVCache,
    LatentCache,
    LayerNorm,
    Linear,
    Mamba2State,
    PerLayerInputs,
    RMSNorm,
    Routing,
)
from eqllm.parametrization import scales
from eqllm.stack import REMAT_POLICIES as REMAT_POLICIES  # re-exported: the remat names
from eqllm.stack import dtype_of, initial_parts, layer_flag, layer_flags, multipliers_of, run_stacks
from eqllm.stack.inputs import check_tokens as check_tokens  # re-exported: callers import it here
from eqllm.stack.run import layer_extra
from eqllm.trees import cast_floating

# Cached inference, per layer: K and V (or latents) per position, or a fixed recurrent state;
# a layer with a mixer beside attention (Falcon-H1's) holds the pair (its K and V, its state);
# None: a feed-forward layer alone (kind "ffn") or a kv-shared layer, which keep nothing.
Entry = KVCache | LatentCache | GatedDeltaNetState | Mamba2State
Cache = tuple[Entry | tuple[KVCache, GatedDeltaNetState | Mamba2State] | None, ...]

# ModelConfig fields that change how the model runs, not what it computes.
EXECUTION_FIELDS = (
    "scan_layers",
    "remat",
    "compute_dtype",
    "attention.kernel",
    "moe.impl",
    "moe.kernel",
    "linear.chunk_size",
)


class CausalLM(eqx.Module):
    """A decoder-only language model: `model(tokens) -> logits`.

    Arguments:
        config: the architecture.
        key: PRNG key for the initial weights (see `init_weights`).

    `tokens` is one sequence (seq,) or a batch (batch, seq). Call it on the batch rather than
    through `jax.vmap`: the same values, but every projection then runs as one 2-D matrix
    product over batch x seq rows, which is much faster on CPU (see `eqllm.nn.linear`).
    """

    embed: Embedding
    pos_embed: Embedding | None
    blocks: Block  # every array has a leading `layers` axis
    final_norm: RMSNorm | LayerNorm
    lm_head: Linear | None  # None when tied to `embed`
    config: ModelConfig = eqx.field(static=True)
    # A mixture of experts' layers with a dense MLP (kind "dense": DeepSeek's first
    # moe.dense_layers, Maverick's between each moe.sparse_every-th), stacked alike in layer
    # order; None otherwise. `blocks` holds the rest (`ModelConfig.layer_kinds`).
    dense_blocks: Block | None = None
    # A hybrid's linear-attention (Gated DeltaNet) layers, stacked alike, in layer order; None
    # otherwise. `blocks` then holds its full-attention layers (`ModelConfig.layer_kinds`).
    linear_blocks: Block | None = None
    # The global layers where they have another shape than the windowed ones (Gemma 4's
    # `attention.global_shape`), stacked alike, in layer order; None otherwise.
    global_blocks: Block | None = None
    # Feed-forward layers without a token mixer (kind "ffn": Nemotron-H's MLP and expert
    # layers), stacked alike, in layer order; None otherwise.
    ffn_blocks: Block | None = None
    # The kv-shared layers (`attention.kv_shared_layers`: kinds "shared" and "shared_global"),
    # stacked alike, in layer order; None otherwise.
    shared_blocks: Block | None = None
    shared_global_blocks: Block | None = None
    # Every layer's per-layer input (`config.per_layer`; None: none).
    per_layer: PerLayerInputs | None = None

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        parts = initial_parts(config, key)
        self.embed = parts["embed"]
        self.pos_embed = parts["pos_embed"]
        self.blocks = parts["blocks"]
        self.final_norm = parts["final_norm"]
        self.lm_head = parts["lm_head"]
        self.config = config
        self.dense_blocks = parts["dense_blocks"]
        self.linear_blocks = parts["linear_blocks"]
        self.global_blocks = parts["global_blocks"]
        self.ffn_blocks = parts["ffn_blocks"]
        self.shared_blocks = parts["shared_blocks"]
        self.shared_global_blocks = parts["shared_global_blocks"]
        self.per_layer = parts["per_layer"]

    def with_config(self, **changes) -> CausalLM:
        """The same weights under changed execution settings (EXECUTION_FIELDS, as dotted keys
        `**{"attention.kernel": "xla"}` or groups `attention={"kernel": "xla"}`).

        Architecture fields cannot change this way: they would change the weights' meaning.
        `moe.impl` of a dense model is ignored (it has no experts to compute), and so is
        `linear.chunk_size` of a model without linear-attention layers.
        """
        changes = dotted(changes)
        if self.config.moe is None:
            changes.pop("moe.impl", None)
            changes.pop("moe.kernel", None)
        if self.config.linear is None:
            changes.pop("linear.chunk_size", None)
        not_allowed = sorted(set(changes) - set(EXECUTION_FIELDS))
        if not_allowed:
            raise ValueError(
                f"with_config changes only {list(EXECUTION_FIELDS)}, not {not_allowed}; "
                "build a new model (CausalLM(config, key=...)) to change the architecture"
            )
        config = self.config.replace(**changes)
        skeleton = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
        return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(self))

    @jax.named_scope("eqllm.CausalLM")
    def __call__(
        self,
        tokens: Int[Array, "*batch seq"],
        positions: Int[Array, "*batch seq"] | None = None,
        segment_ids: Int[Array, "*batch seq"] | None = None,
    ) -> Float[Array, "*batch seq vocab"]:
        """Next-token logits (fp32) for every position of a sequence or a batch of them.

        Arguments:
            tokens: token ids in [0, vocab_size), shape (seq,) or (batch, seq). Concrete ids are
                checked here; inside `jax.jit` the caller checks them (the train step and
                generation do, on the host), since an out-of-range id would read a wrong row.
            positions: absolute positions (default 0..seq-1); a negative position marks padding.
            segment_ids: packed documents (default: one): a token attends only to earlier
                tokens with the same id, so each document's logits are those it has alone
                (with its own positions, e.g. restarting at 0: `eqllm.data.document_positions`).
        """
        return self.routed(tokens, positions, segment_ids)[0]

    def routed(
        self,
        tokens: Int[Array, "*batch seq"],
        positions: Int[Array, "*batch seq"] | None = None,
        segment_ids: Int[Array, "*batch seq"] | None = None,
    ) -> tuple[Float[Array, "*batch seq vocab"], Float[Array, "layers *batch seq experts"] | None]:
        """`self(tokens, positions, segment_ids)` and every layer's router logits (None without
        experts), for the load-balancing loss (`eqllm.nn.load_balancing_loss`)."""
        logits, routing = self.routing(tokens, positions, segment_ids)
        return logits, None if routing is None else routing.logits

    def routing(
        self,
        tokens: Int[Array, "*batch seq"],
        positions: Int[Array, "*batch seq"] | None = None,
        segment_ids: Int[Array, "*batch seq"] | None = None,
    ) -> tuple[Float[Array, "*batch seq vocab"], Routing | None]:
        """`self(tokens, positions, segment_ids)` and every layer's `Routing` stacked (router
        logits and the copies dropped past the capacity; None without experts)."""
        check_tokens(tokens, self.config)
        hidden, routing = self._forward(tokens, positions, segment_ids)
        return self.logits(hidden), routing

    def hidden(
        self,
        tokens: Int[Array, "*batch seq"],
        positions: Int[Array, "*batch seq"] | None = None,
        segment_ids: Int[Array, "*batch seq"] | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        """The final-norm hidden states, in the compute dtype."""
        return self._forward(tokens, positions, segment_ids)[0]

    def _forward(self, tokens, positions, segment_ids=None):
        cfg = self.config
        in_order = positions is None  # lets attention skip the masked-out key blocks
        if in_order:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
        model = cast_floating(self, dtype_of(cfg.compute_dtype))  # the one compute-dtype cast
        x = model.embed_inputs(tokens, positions)
        stacks = {f: getattr(model, f) for f in STACKS.values()}
        per_layer = model.per_layer_inputs(tokens, x)
        at = None if in_order else positions
        x, routing = run_stacks(stacks, x, at, cfg, segment_ids, per_layer)
        return model.final_norm(x), routing

    def per_layer_inputs(
        self, tokens: Int[Array, "*batch seq"], x: Float[Array, "*batch seq d_model"]
    ) -> Float[Array, "layers *batch seq d"] | None:
        """Every layer's own input (`config.per_layer`) from the tokens and their embeddings
        `x` (`embed_inputs`), layers leading; None for a model without."""
        return None if self.per_layer is None else self.per_layer(tokens, x)

    def embed_inputs(
        self, tokens: Int[Array, "*batch seq"], positions: Int[Array, "*batch seq"]
    ) -> Float[Array, "*batch seq d_model"]:
        """Token embeddings (scaled, plus learned positions where the family has them)."""
        cfg = self.config
        x = self.embed(tokens)  # (..., seq, d_model)
        if cfg.embed_scale:
            # Gemma rounds sqrt(d_model) to the compute dtype before multiplying.
            x = x * jnp.asarray(math.sqrt(cfg.d_model), x.dtype)
        if (m := multipliers_of(cfg).embedding) != 1.0:  # Falcon-H1's embedding_multiplier
            x = x * m
        if self.pos_embed is not None:
            x = x + self.pos_embed(jnp.maximum(positions, 0))
        return x

    def logits(self, hidden: Float[Array, "*rows d_model"]) -> Float[Array, "*rows vocab"]:
        """LM head on hidden states (soft-capped where the config says); fp32 throughout."""
        if self.lm_head is None:
            logits = self.embed.attend(hidden, preferred_element_type=jnp.float32)
        else:
            logits = self.lm_head(hidden, preferred_element_type=jnp.float32)
        readout = scales(self.config).readout  # muP's output_mult / width ratio; SP: 1
        if (m := multipliers_of(self.config).logits) != 1.0:  # Falcon-H1's lm_head_multiplier
            logits = logits * m
        if (d := multipliers_of(self.config).logits_divisor) != 1.0:  # Granite's logits_scaling
            logits = logits / d
        if readout != 1.0:
            logits = logits * readout
        cap = self.config.final_softcap
        return logits if cap is None else jnp.tanh(logits / cap) * cap

    # Cached inference: one sequence at a time (vmap for a batch), the layers unrolled: under
    # `lax.scan`, XLA on CPU copied each layer's weights out of the stack at every decode step,
    # 3-4x slower (gpt2-small). Its compile time grows with depth; training's does not.

    def init_cache(self, length: int) -> Cache:
        """An empty cache for one sequence of up to `length` positions, one entry per layer:
        `min(length, max_seq_len)` slots of kv heads in the compute dtype (a ring of just the
        window in a windowed or chunked layer), or a linear-attention or Mamba-2 layer's
        fixed-size state (its convolution's last inputs in the compute dtype; its recurrent
        state in fp32, or a Mamba-2 layer's `state_dtype`); None for a feed-forward layer alone
        (kind "ffn") and a kv-shared layer, which keep nothing. A layer that runs a mixer beside
        attention
        (`linear.parallel`) holds both: the pair (its KV cache, its mixer's state).
        """
        cfg = self.config
        dtype = dtype_of(cfg.compute_dtype)
        full = min(length, cfg.max_seq_len)
        a = cfg.attention
        if a.kind == "mla":  # the latent and the rotary key only
            latent = LatentCache.empty(full, a.kv_lora_rank, a.qk_rope_head_dim, dtype)
            return (latent,) * cfg.n_layers
        # A chunk needs at most its own chunk_size - 1 earlier keys: a ring of chunk_size too.
        window, kv_heads = a.sliding_window or a.chunk_size, a.n_kv_heads
        local = KVCache.empty(min(full, window or full), kv_heads, cfg.head_dim, dtype)
        world = KVCache.empty(full, kv_heads, cfg.head_dim, dtype)
        if a.global_shape:  # Gemma 4: the global layers' own heads
            world = KVCache.empty(
                full, a.global_kv_heads or kv_heads, a.global_head_dim or cfg.head_dim, dtype
            )
        caches = tuple(local if w else world for w in cfg.local_layers())
        if cfg.linear is None:  # a kv-shared layer reads its source's cache: none of its own
            shared = kv_sources(cfg)
            return tuple(None if i in shared else c for i, c in enumerate(caches))
        if cfg.linear.parallel:  # every layer: attention and its mixer's state (Falcon-H1)
            state = self.blocks.ssm.init_state(dtype=dtype)
            return tuple((c, state) for c in caches)
        kinds, entries = cfg.layer_kinds(), {"ffn": None}  # a feed-forward layer keeps nothing
        if "linear" in kinds:
            mixers = getattr(self, stack_field(cfg, "linear"))  # `blocks` without attention
            entries["linear"] = mixers.attn.init_state(dtype=dtype)  # conv inputs, S in its own
        return tuple(entries.get(k, c) for k, c in zip(kinds, caches, strict=True))

    def layers(self) -> tuple[Block, ...]:
        """The stacked blocks sliced apart, one Block per layer, in the compute dtype.

        Pass them to `prefill` / `decode` called in a compiled loop: sliced inside the loop, every
        layer's weights were copied at every step (halving decode speed on CPU, gpt2-small).
        """
        dtype = dtype_of(self.config.compute_dtype)

        def sliced(stack):
            if stack is None:
                return []
            params, static = eqx.partition(stack, eqx.is_array)
            params = cast_floating(params, dtype)
            n = jax.tree.leaves(params)[0].shape[0]
            return [
                eqx.combine(jax.tree.map(lambda a, i=i: a[i], params), static) for i in range(n)
            ]

        by_stack = {f: iter(sliced(getattr(self, f))) for f in STACKS.values()}
        order = layer_stacks(self.config)
        return tuple(next(by_stack[f]) for f in order)  # in layer order

    def without_stacks(self) -> CausalLM:
        """The model with its stacked blocks removed (None): what stays beside `layers()` when
        only the sliced layers are kept."""
        fields = tuple(STACKS.values())
        where = lambda m: tuple(getattr(m, f) for f in fields)  # noqa: E731
        return eqx.tree_at(where, self, (None,) * len(fields), is_leaf=lambda x: x is None)

    def with_layers(self, layers: Sequence[Block]) -> CausalLM:
        """The model with its stacks rebuilt from `layers` as `layers()` slices them (in layer
        order): the inverse, for a call that needs the stacked form."""
        fields = tuple(STACKS.values())
        order = layer_stacks(self.config)

        def stack(field):
            part = [layer for layer, f in zip(layers, order, strict=True) if f == field]
            return jax.tree.map(lambda *a: jnp.stack(a), *part) if part else None

        where = lambda m: tuple(getattr(m, f) for f in fields)  # noqa: E731
        rebuilt = tuple(stack(f) for f in fields)
        return eqx.tree_at(where, self, rebuilt, is_leaf=lambda x: x is None)

    @jax.named_scope("eqllm.CausalLM.prefill")
    def prefill(
        self,
        tokens: Int[Array, " seq"],
        positions: Int[Array, " seq"],
        cache: Cache,
        *,
        layers: tuple[Block, ...] | None = None,
    ) -> tuple[Float[Array, " vocab"], Cache]:
        """Write a chunk of a sequence into `cache`; the logits (fp32) after its last token.

        Arguments:
            tokens: the prompt, or a further chunk of a sequence already in `cache`.
            positions: absolute positions, contiguous; a negative position marks padding, which
                is neither cached nor attended to. Pad on the left: the last entry must be real.
            cache: from `init_cache` (or a previous call).
            layers: `self.layers()`, when computed once outside a loop (None: slice here).

        Returns:
            The next-token logits and the cache with the chunk written in.
        """
        model = cast_floating(self, dtype_of(self.config.compute_dtype))  # no-op when cast
        layers = model.layers() if layers is None else layers
        x = model.embed_inputs(tokens, positions)
        inputs = model.per_layer_inputs(tokens, x)
        written, shared = [], {}
        for i, (call, layer_cache) in enumerate(
            zip(model.cached_calls(layers), cache, strict=True)
        ):
            extra = layer_extra(model.config, i, layers, x, positions, layer_cache, inputs, shared)
            x, layer_cache = call(x, positions, layer_cache, **extra)
            written.append(layer_cache)
        return model.next_logits(x), tuple(written)

    def cached_calls(self, layers: Sequence[Block]) -> list[Callable]:
        """Each layer's cached call with its flags bound: `call(x, positions, cache)` returns
        (x, cache) as `Block.cached` does. `prefill` runs them in order; a caller that keeps
        the caches elsewhere (the serving engine's paged pools) runs them one by one."""
        local, rotate = layer_flags(self.config)
        return [
            functools.partial(
                block.cached, local=layer_flag(local, i), rotate=layer_flag(rotate, i)
            )
            for i, block in enumerate(layers)
        ]

    def next_logits(self, x: Float[Array, "seq d_model"]) -> Float[Array, " vocab"]:
        """The logits after the last position of the last layer's output (fp32)."""
        return self.logits(self.final_norm(x[-1]))

    @jax.named_scope("eqllm.CausalLM.decode")
    def decode(
        self,
        token: Int[Array, ""],
        position: Int[Array, ""],
        cache: Cache,
        *,
        layers: tuple[Block, ...] | None = None,
    ) -> tuple[Float[Array, " vocab"], Cache]:
        """Feed one token at `position` after those in `cache`: `prefill` of a chunk of one."""
        return self.prefill(token[None], position[None], cache, layers=layers)

"""The residual Transformer block: pre-norm (GPT-2 / Llama layout; Xiong et al., 2020), with
optional norms on each sublayer's output before the residual add (Gemma 2 has both, OLMo 2 only
those), sequential or parallel (attention and MLP both read the block's input: GPT-J, GPT-NeoX;
Black et al., 2022); with a second token mixer beside attention (`ssm`: Falcon-H1's Mamba-2 in
every layer, both reading the normed input, their outputs summed)."""

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Float, Int

from eqllm.nn.attention import Attention
from eqllm.nn.dispatch import ExpertHooks
from eqllm.nn.gated_deltanet import GatedDeltaNet, GatedDeltaNetState
from eqllm.nn.kv_cache import KVCache
from eqllm.nn.mamba2 import Mamba2
from eqllm.nn.mla import LatentCache, MultiHeadLatentAttention
from eqllm.nn.mlp import MLP, GatedMLP
from eqllm.nn.moe import MoE, Routing
from eqllm.nn.norm import LayerNorm, RMSNorm
from eqllm.nn.per_layer import PerLayerGate
from eqllm.nn.ssd import Mamba2State

Norm = RMSNorm | LayerNorm
State = GatedDeltaNetState | Mamba2State
# One layer's cache: keys and values (or latents), a recurrent state, both (with `ssm`), or
# nothing (a feed-forward layer alone).
Cache = KVCache | LatentCache | State | tuple[KVCache, State] | None


def _apply(norm: Norm | None, x):
    return x if norm is None else norm(x)


def _scaled(x, scale: float):
    return x if scale == 1.0 else x * scale


class Block(eqx.Module):
    """x + post1(attn(norm1(x))), then x + post2(mlp(norm2(x))), on one sequence or a batch;
    parallel: x + post1(attn(norm1(x))) + post2(mlp(norm2(x))), both sublayers reading x.

    Attributes:
        attn_norm: the norm applied before attention (None: none).
        attn: the token mixer: self-attention (grouped-query or latent), or a Gated DeltaNet or
            Mamba-2 (a linear-attention or state-space layer; it takes no positions, and
            segment ids reset its state); None: none, the block is norm -> feed-forward ->
            residual (Nemotron-H's MLP and expert layers).
        mlp_norm: the norm applied before the feed-forward layer (None: none).
        mlp: the feed-forward layer (a mixture of experts in a sparse model; None: none, the
            block is norm -> mixer -> residual, as Mamba-2's).
        attn_post_norm: the norm applied to attention's output before it is added to the
            residual stream (None: none).
        mlp_post_norm: the same for the feed-forward layer's output (None: none).
        branch_scale: multiplies each sublayer's output before the residual add (CompleteP's
            base_n_layers / n_layers; 1.0 adds it as it is).
        parallel: the MLP reads the block's input, not the attention's output (GPT-NeoX's
            use_parallel_residual).
        ssm: a second token mixer on the same normed input as `attn` (a Mamba-2 or Gated
            DeltaNet; its state resets with the segment ids), its output added to attention's
            before the residual add (Falcon-H1; None: none).
        multipliers: constants on the mixers: `attn`'s input and output, and `ssm`'s output
            (Falcon-H1's attention_in, attention_out and ssm_out multipliers; 1.0: none).
        layer_scalar: multiplies the block's whole output, shape (1,) (Gemma 4's stored
            `layer_scalar`; None: none).
        per_layer: adds the layer's own input (`per_layer_input` of each call) after the MLP,
            through a gate of the hidden state (Gemma 4 E2B/E4B; `eqllm.nn.per_layer`; None:
            none).

    A kv-shared layer (its attention built with `kv_shared`) takes its source layer's keys
    and values as `shared` (`keys_values` of the source's block).
    """

    attn_norm: Norm | None
    attn: Attention | MultiHeadLatentAttention | GatedDeltaNet | Mamba2 | None
    mlp_norm: Norm | None
    mlp: MLP | GatedMLP | MoE | None
    attn_post_norm: Norm | None = None
    mlp_post_norm: Norm | None = None
    branch_scale: float = eqx.field(static=True, default=1.0)
    parallel: bool = eqx.field(static=True, default=False)
    ssm: GatedDeltaNet | Mamba2 | None = None
    multipliers: tuple[float, float, float] = eqx.field(static=True, default=(1.0, 1.0, 1.0))
    layer_scalar: Float[Array, "1"] | None = None
    per_layer: PerLayerGate | None = None

    def _mixed(self, h, attended, segment_ids=None):
        """Attention's output `attended` scaled, plus the parallel mixer's on `h` (if any)."""
        attended = _scaled(attended, self.multipliers[1])
        if self.ssm is None:
            return attended
        return attended + _scaled(self.ssm(h, None, segment_ids)[0], self.multipliers[2])

    def _residual(self, x, attended, moe_impl=None, experts=None, per_layer_input=None):
        """The block's output from its input `x` and attention's output `attended` (with its
        per-layer input added and times `layer_scalar`, where the block has them)."""
        out, routing = self._sublayers(x, attended, moe_impl, experts)
        if self.per_layer is not None:
            if per_layer_input is None:
                raise ValueError("a block with per-layer inputs needs its per_layer_input")
            out = self.per_layer(out, per_layer_input)
        if self.layer_scalar is not None:
            out = out * self.layer_scalar.astype(out.dtype)
        return out, routing

    def _sublayers(self, x, attended, moe_impl=None, experts=None):
        after_attn = x + _scaled(_apply(self.attn_post_norm, attended), self.branch_scale)
        if self.mlp is None:
            return after_attn, None
        return self._feed_forward(after_attn, x if self.parallel else after_attn, moe_impl, experts)

    def _feed_forward(self, x, h=None, moe_impl=None, experts=None):
        """x plus the feed-forward layer's output on `h` (None: on x itself), and its Routing."""
        h = _apply(self.mlp_norm, x if h is None else h)
        if isinstance(self.mlp, MoE):
            out, routing = self.mlp.routed(h, moe_impl, experts)
        else:
            out, routing = self.mlp(h), None
        return x + _scaled(_apply(self.mlp_post_norm, out), self.branch_scale), routing

    @jax.named_scope("eqllm.Block")
    def __call__(
        self,
        x: Float[Array, "*batch seq d_model"],
        positions: Int[Array, "*batch seq"] | None = None,
        local: Bool[Array, ""] | bool | None = None,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        rotate: Bool[Array, ""] | bool | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        """`local`: this layer's window flag; `segment_ids`: packed documents; `rotate`: this
        layer's rotary flag, False in a NoPE layer (see `eqllm.nn.attention`)."""
        return self.routed(x, positions, local, segment_ids, rotate)[0]

    def routed(
        self,
        x: Float[Array, "*batch seq d_model"],
        positions: Int[Array, "*batch seq"] | None = None,
        local: Bool[Array, ""] | bool | None = None,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        rotate: Bool[Array, ""] | bool | None = None,
        experts: ExpertHooks | None = None,
        per_layer_input: Float[Array, "*batch seq d"] | None = None,
        shared: tuple[Array, Array] | None = None,
    ) -> tuple[Float[Array, "*batch seq d_model"], Routing | None]:
        """The block's output and its `Routing` (router logits, dropped copies; None unless
        `mlp` is a mixture of experts). `experts`: how a mesh places or dispatches a mixture
        of experts' experts (`eqllm.nn.dispatch.ExpertHooks`, from the FSDP layer hook).
        `per_layer_input`: this layer's input (a block with `per_layer`); `shared`: a
        kv-shared layer's keys and values (its source's `keys_values`)."""
        if self.attn is None:  # a feed-forward layer alone
            return self._feed_forward(x, experts=experts)
        h = _apply(self.attn_norm, x)
        h_in = _scaled(h, self.multipliers[0])
        if isinstance(self.attn, GatedDeltaNet | Mamba2):  # recurrent: order is position
            attended = self.attn(h_in, None, segment_ids)[0]
        elif shared is not None:
            attended = self.attn(h_in, positions, local, segment_ids, rotate, shared)
        else:
            attended = self.attn(h_in, positions, local, segment_ids, rotate)
        mixed = self._mixed(h, attended, segment_ids)
        return self._residual(x, mixed, experts=experts, per_layer_input=per_layer_input)

    def keys_values(
        self,
        x: Float[Array, "*batch seq d_model"],
        positions: Int[Array, "*#batch seq"],
        local: Bool[Array, ""] | bool | None = None,
        rotate: Bool[Array, ""] | bool | None = None,
    ) -> tuple[Array, Array]:
        """The keys and values this block's attention computes from its input `x` (normed and
        rotated, as `Attention.project` returns them): what its kv-shared layers attend to."""
        h = _scaled(_apply(self.attn_norm, x), self.multipliers[0])
        return self.attn.project(h, positions, local, rotate)[1:]

    @jax.named_scope("eqllm.Block.cached")
    def cached(
        self,
        x: Float[Array, "seq d_model"],
        positions: Int[Array, " seq"],
        cache: Cache,
        local: Bool[Array, ""] | bool | None = None,
        rotate: Bool[Array, ""] | bool | None = None,
        per_layer_input: Float[Array, "seq d"] | None = None,
        shared: tuple[KVCache, Array, Array] | None = None,
    ) -> tuple[Float[Array, "seq d_model"], Cache]:
        """The block on a chunk of new positions, attending to `cache` (see Attention.cached);
        a Gated DeltaNet or Mamba-2 layer continues its recurrent state instead (its `cache`),
        skipping the chunk's left padding (negative positions). A block with a mixer beside
        attention (`ssm`) takes the pair (attention's cache, the mixer's state) and returns
        both continued; a feed-forward layer alone keeps nothing (its `cache` is None).

        `per_layer_input`: this layer's input (a block with `per_layer`). A kv-shared layer
        takes `shared`, its source's cache before the chunk and the chunk's keys and values
        (`keys_values`), and keeps nothing (its `cache` is None).

        Experts are computed densely here: generation runs this under `jax.vmap`, which the
        grouped ("ragged") product does not support, and a decode step has one token anyway.
        """
        if self.attn is None:  # a feed-forward layer alone keeps nothing: its cache is as given
            return self._feed_forward(x, None, "dense")[0], cache
        h = _apply(self.attn_norm, x)
        h_in = _scaled(h, self.multipliers[0])
        valid = positions >= 0
        if isinstance(self.attn, GatedDeltaNet | Mamba2):
            attended, cache = self.attn(h_in, cache, valid=valid)
            return self._residual(x, self._mixed(h, attended), "dense")[0], cache
        if self.ssm is None:
            kv_shared = {} if shared is None else {"shared": shared}  # Gemma 4's shared layers
            attended, cache = self.attn.cached(h_in, positions, cache, local, rotate, **kv_shared)
            out = self._residual(x, self._mixed(h, attended), "dense", None, per_layer_input)
            return out[0], cache
        kv, state = cache
        attended, kv = self.attn.cached(h_in, positions, kv, local, rotate)
        mixed, state = self.ssm(h, state, valid=valid)  # on the unscaled input, as in `_mixed`
        out = _scaled(attended, self.multipliers[1]) + _scaled(mixed, self.multipliers[2])
        return self._residual(x, out, "dense")[0], (kv, state)

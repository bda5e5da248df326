"""Which stack each layer belongs to, and the segments the stack runs them in.

A model's layers are of up to seven kinds (`ModelConfig.layer_kinds`), each held by one stacked
Block of `CausalLM`: "dense" (a mixture of experts' layers with the dense MLP: DeepSeek's
first `moe.dense_layers`, Llama 4 Maverick's layers between each `moe.sparse_every`-th;
`dense_blocks`), "full" (softmax attention, the main stack: `blocks`), "linear" (a hybrid's
Gated DeltaNet or Mamba-2 layers: `linear_blocks`; `blocks` when no layer has attention),
"ffn" (a feed-forward layer without a token mixer, the MLP or the experts: Nemotron-H's,
`ffn_blocks`) and "global" (the layers without the window where they have another shape than
the windowed ones: Gemma 4's head size, kv heads, keys as values and proportional RoPE,
`attention.global_shape` or `positions.global_fraction`; `global_blocks`, `blocks` when every
layer is global). The last `attention.kv_shared_layers` layers, which attend to an earlier
layer's keys and values (`eqllm.config.per_layer`), are "shared" (`shared_blocks`) or, where
the global layers have a stack of their own, "shared_global" (`shared_global_blocks`).

Everything that walks layers (the forward pass, the sliced layers of generation, the hub's key
tables, sharding, the per-layer gradient norms) maps a layer to (stack, index in the stack)
through `stack_layers`. The forward pass runs the layers in `segments`: a run of one kind, or a
pattern of kinds repeated, each one compiled body however deep.
"""

from __future__ import annotations

from typing import NamedTuple

# The CausalLM field holding each kind's layers, stacked in layer order.
STACKS = {
    "dense": "dense_blocks",
    "full": "blocks",
    "linear": "linear_blocks",
    "ffn": "ffn_blocks",
    "global": "global_blocks",
    "shared": "shared_blocks",
    "shared_global": "shared_global_blocks",
}


def layer_kinds(config) -> tuple[str, ...]:
    """Per layer of `config` (a ModelConfig): "dense", "full", "linear", "ffn", "global",
    "shared" or "shared_global" (see the module)."""
    n = config.n_layers
    kinds = ["full"] * n if config.linear is None else list(config.linear.kinds(n))
    if config.attention.global_shape or config.positions.global_fraction is not None:
        kinds = ["full" if w else "global" for w in config.local_layers()]
    if (moe := config.moe) is not None:
        for i in range(n):
            if i < moe.dense_layers or (i + 1) % moe.sparse_every != 0:
                kinds[i] = "dense"
    for i in range(n - (config.attention.kv_shared_layers or 0), n):  # no keys of their own
        kinds[i] = "shared_global" if kinds[i] == "global" else "shared"
    return tuple(kinds)


def stack_field(config, kind: str) -> str:
    """The CausalLM field holding the layers of `kind` ("blocks" for a stack of linear or global
    layers alone: a pure Mamba-2 model has one stack)."""
    if kind in ("linear", "global") and "full" not in layer_kinds(config):
        return "blocks"
    return STACKS[kind]


def stack_layers(config) -> dict[str, tuple[int, ...]]:
    """{CausalLM field: the model's layer index of each layer of that stack, in order}, for the
    stacks the model has."""
    stacks: dict[str, list[int]] = {}
    for i, kind in enumerate(layer_kinds(config)):
        stacks.setdefault(stack_field(config, kind), []).append(i)
    return {field: tuple(layers) for field, layers in stacks.items()}


def layer_stacks(config) -> tuple[str, ...]:
    """Per layer, the CausalLM field of the stack holding it."""
    return tuple(stack_field(config, kind) for kind in layer_kinds(config))


class Segment(NamedTuple):
    """Layers start .. start + len(pattern) * repeats - 1: `pattern` (kinds in order) repeated."""

    start: int
    pattern: tuple[str, ...]
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + len(self.pattern) * self.repeats


def segments(kinds: tuple[str, ...]) -> tuple[Segment, ...]:
    """`kinds` cut into segments, each a pattern repeated, from the first layer on.

    At each point the segment covering the most layers is taken (ties: the shortest pattern):
    a run of one kind is the pattern of one; a longer pattern needs two repeats at least, so
    an irregular stretch becomes runs. A depth that is not a whole number of periods leaves a
    remainder, cut the same way: `("linear",) * 3 + ("full",)` twice then two "linear" is
    (LLLF x 2, L x 2); DeepSeek's dense prefix then experts is (D x k, F x rest); Maverick's
    alternation is (DF x n/2).
    """
    out, start, n = [], 0, len(kinds)
    while start < n:
        best = Segment(start, (kinds[start],), 1)
        for period in range(1, (n - start) // 2 + 1 if n - start > 1 else 2):
            pattern = kinds[start : start + period]
            repeats = 1
            while kinds[start + repeats * period : start + (repeats + 1) * period] == pattern:
                repeats += 1
            if period > 1 and repeats < 2:
                continue
            if period * repeats > len(best.pattern) * best.repeats:
                best = Segment(start, pattern, repeats)
        out.append(best)
        start = best.stop
    return tuple(out)


def pipeline_layers(config) -> tuple[int, int]:
    """(layers run before a pipeline's stages, layers the stages split): a mixture of experts'
    leading run of dense layers (DeepSeek's first `moe.dense_layers`) runs before the stages,
    on every device, as the embeddings do; the stages split the rest into equal runs."""
    kinds = layer_kinds(config)
    prefix = 0
    while prefix < len(kinds) and kinds[prefix] == "dense":
        prefix += 1
    if "dense" in kinds[prefix:]:  # dense layers between expert layers (Maverick's): no prefix
        prefix = 0
    return prefix, len(kinds) - prefix

"""Recurrent state in the engine: a linear-attention layer (Gated DeltaNet) or a state-space
layer (Mamba-2) keeps, per sequence, a state of a fixed size (a Gated DeltaNet's d_k x d_v
matrix S per value head, a Mamba-2 head's head_dim x d_state S, and the convolution's last
inputs) where an attention layer keeps keys and values per position.

The state lives in the engine's one device state (`SlotState.cache`), in the place of the
layer's paged pool: the layer's state (`GatedDeltaNetState`, `Mamba2State`) with a leading
`slots` axis, one per recurrent layer, beside the attention layers' pools (a stack of Mamba-2
layers alone has no pool at all). A layer that runs a mixer beside attention (Falcon-H1's) has
the pair (its pool, its state) as its entry. Every function here acts on any such state as a
pytree, and on the states inside a pair, so every layer kind shares one mechanism. A prefill
call gathers its rows' states by slot (a row's first chunk starts from zeros: the state a
finished request left in the slot is cleared before the new request reads it), runs the
chunk, and writes them back; a decode call runs the first `slots` slots' states in place.
Padding (negative positions, and slots a call does not run) leaves a state as it is, so a
prompt may go in over several chunks.

The state at the end of a cached prefix is not kept with the prefix's blocks, so an engine
over a model with recurrent layers does not reuse cached prefixes (`prefix_cache` is off for
it), and speculative decoding, which would need to roll the state back past rejected guesses,
refuses it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from eqllm.errors import EqllmError
from eqllm.model import CausalLM
from eqllm.nn import GatedDeltaNetState, Mamba2State

# What a recurrent layer carries from call to call; None for a feed-forward layer alone (kind
# "ffn"), which keeps nothing: a state without arrays, carried through as it is.
State = GatedDeltaNetState | Mamba2State | None


def is_state(entry) -> bool:
    """Whether a layer's entry of the engine's cache is a recurrent state (not a pool)."""
    return isinstance(entry, State)


def parts(entry) -> tuple:
    """A layer's entry as a tuple of its parts (a pool or state alone, or both of a pair)."""
    return entry if isinstance(entry, tuple) else (entry,)


def on_states(fn, *entries):
    """`fn` applied to a layer's entries (one per cache given, alike) where they are states:
    the entry itself, or the states inside a pair; anything else (a pool) is the last entry
    given, as it is (the written one, when `fn` puts written states back)."""
    first = entries[0]
    if is_state(first):
        return fn(*entries)
    if isinstance(first, tuple):
        return tuple(on_states(fn, *parts) for parts in zip(*entries, strict=True))
    return entries[-1]


def for_slots(template: State, slots: int) -> State:
    """Zero states of `slots` sequences shaped like one sequence's `template`."""
    return jax.tree.map(lambda a: jnp.zeros((slots, *a.shape), a.dtype), template)


def gather(cache: tuple, slots: Int[Array, " rows"], first: Bool[Array, " rows"]) -> tuple:
    """`cache` with each state replaced by its rows' states (by slot; zeros for a row whose
    chunk is its sequence's first, or whose slot is out of range: padding)."""

    def rows(state):
        def take(a):
            got = a.at[slots].get(mode="fill", fill_value=0)
            return jnp.where(first.reshape(-1, *(1,) * (a.ndim - 1)), 0, got).astype(a.dtype)

        return jax.tree.map(take, state)

    return tuple(on_states(rows, c) for c in cache)


def scatter(cache: tuple, written: tuple, slots: Int[Array, " rows"]) -> tuple:
    """`written` (a call's output over gathered rows) with each state put back into the slots
    of `cache` (rows whose slot is out of range are dropped)."""

    def put(whole, rows):
        return jax.tree.map(lambda a, r: a.at[slots].set(r, mode="drop"), whole, rows)

    return tuple(on_states(put, c, w) for c, w in zip(cache, written, strict=True))


def first_slots(cache: tuple, n: int) -> tuple:
    """`cache` with each state cut to its first `n` slots (a decode call's rows)."""
    return tuple(on_states(lambda c: jax.tree.map(lambda a: a[:n], c), c) for c in cache)


def put_first(cache: tuple, written: tuple, n: int) -> tuple:
    """The inverse of `first_slots`: `written`'s states put back into the first `n` slots."""

    def put(whole, rows):
        return jax.tree.map(lambda a, r: a.at[:n].set(r), whole, rows)

    return tuple(on_states(put, c, w) for c, w in zip(cache, written, strict=True))


def refuse_speculation(model: CausalLM, role: str) -> None:
    """Raise for a target or draft with recurrent layers (a hybrid, or Mamba-2 alone) in
    speculative decoding: rejected guesses would have to be undone in its recurrent state,
    which the engine does not keep per guess."""
    cfg = model.config
    if cfg.linear is not None:
        kind = "state-space" if cfg.linear.pure else "hybrid"
        raise EqllmError(
            f"speculative decoding with a {kind} {role} (family={cfg.family!r}, "
            f"linear.kind={cfg.linear.kind!r}) is not supported: its recurrent state cannot be "
            "rolled back past rejected guesses; serve it without --speculate/--draft"
        )

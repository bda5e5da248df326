"""SOAP: Adam run in the eigenbasis of Shampoo's preconditioners (Vyas et al. 2024, "SOAP:
Improving and Stabilizing Shampoo using Adam", arXiv 2409.11321), as an optax transformation.

optax has no SOAP; this follows the authors' reference (github.com/nikhilvyas/SOAP, soap.py,
with `merge_dims`, `precondition_1d` and `normalize_grads` off, their defaults):

- A matrix G (m, n) keeps Shampoo's statistics L = EMA(G G^T) (m, m) and R = EMA(G^T G) (n, n)
  (decay `shampoo_beta`) and their eigenbases Q_L, Q_R. Adam's moments live in the rotated
  space: G' = Q_L^T G Q_R, m = EMA(G'), v = EMA(G'^2), and the step is
  Q_L (m / (sqrt(v) + eps)) Q_R^T, with Adam's bias correction sqrt(1 - b2^t) / (1 - b1^t).
- The first call only accumulates L and R and takes their eigenbases (eigh, eigenvalues in
  descending order); it moves nothing (the reference skips it, so that the projection never uses
  the current gradient). Adam's step t counts from the second call.
- Every `precondition_frequency` steps, after L and R take the step's gradient, each basis is
  refreshed by one power iteration and a QR (Q <- qr(L Q)), its columns first sorted by the
  estimated eigenvalues diag(Q^T L Q) in descending order and v's rows (columns) permuted
  alike; m is rotated from the old basis into the new one. (The reference rotates m back and
  forth through the unchanged basis on the other steps too: equal up to rounding.)
- A side longer than `max_precond_dim` keeps the identity (no statistic, no basis): a
  vocabulary axis, say. Arrays that are not matrices (biases, norm scales) take the same Adam in
  the identity basis, first call skipped included, as the reference's 1-D path does.
- Decoupled weight decay as the reference applies it, after the step: w <- (w - lr u) (1 - lr wd).

Which arrays are matrices is the caller's to say (`matrices`, a tree of bools): the matrix is
the last two axes; every axis before them (a scanned stack's `layers`, a MoE's `expert`) is a
batch axis, each matrix with its own statistics and bases (vmapped over those axes).
Cost per (m, n) matrix: two eigendecompositions at the first step, then two QRs every
`precondition_frequency` steps, four (m, m)/(n, n) products a step for the rotations; memory
2 (m^2 + n^2) for the statistics and bases beside Adam's 2 m n.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

Matrix = Float[Array, "batch m n"]
Side = tuple[Array | None, Array | None]  # (left, right); None where a side keeps the identity


class SoapLeaf(NamedTuple):
    """One array's state: Adam's moments (in the rotated space) and, for a matrix, each side's
    Shampoo statistic and eigenbasis, stacked over the batch axes."""

    mu: Array
    nu: Array
    stats: Side
    bases: Side


class SoapState(NamedTuple):
    count: Int[Array, ""]  # calls so far; Adam's step t is count (the first call is skipped)
    leaves: object  # a `SoapLeaf` at every array, shaped like the parameters


def _project(x: Matrix, bases: Side) -> Matrix:
    """Q_L^T x Q_R (each side only where it has a basis)."""
    left, right = bases
    if left is not None:
        x = jnp.einsum("bim,bin->bmn", left, x)
    if right is not None:
        x = jnp.einsum("bmj,bjn->bmn", x, right)
    return x


def _project_back(x: Matrix, bases: Side) -> Matrix:
    """Q_L x Q_R^T: the inverse rotation of `_project`."""
    left, right = bases
    if left is not None:
        x = jnp.einsum("bim,bmn->bin", left, x)
    if right is not None:
        x = jnp.einsum("bmn,bjn->bmj", x, right)
    return x


def _accumulate(stats: Side, g: Matrix, beta: float) -> Side:
    """L <- beta L + (1 - beta) G G^T, R <- beta R + (1 - beta) G^T G."""
    left, right = stats
    if left is not None:
        left = beta * left + (1 - beta) * jnp.einsum("bin,bjn->bij", g, g)
    if right is not None:
        right = beta * right + (1 - beta) * jnp.einsum("bmi,bmj->bij", g, g)
    return left, right


def _eigenbasis(stat: Array | None) -> Array | None:
    """Eigenvectors of a symmetric statistic, largest eigenvalue first."""
    if stat is None:
        return None
    eye = jnp.eye(stat.shape[-1], dtype=stat.dtype)
    _, vectors = _one_at_a_time(jnp.linalg.eigh, stat + 1e-30 * eye)
    return vectors[..., ::-1]


def _one_at_a_time(decompose, batch: Array):
    """`decompose` over a batch of matrices one matrix at a time (`lax.map`): jaxlib's batched
    CPU LAPACK kernels split a batch over XLA's intra-op thread pool and wait for it, and two
    such waits at once left every thread idle for good (a llama-nano train step on 2 cores)."""
    return jax.lax.map(decompose, batch)


def _refresh(stats: Side, bases: Side, nu: Matrix) -> tuple[Side, Matrix]:
    """One power iteration and QR per side, columns sorted by the estimated eigenvalues and
    nu's matching axis permuted alike (the reference's `get_orthogonal_matrix_QR`)."""
    new = []
    for axis, (stat, basis) in enumerate(zip(stats, bases, strict=True)):
        if stat is None:
            new.append(None)
            continue
        estimate = jnp.einsum("bim,bij,bjm->bm", basis, stat, basis)
        order = jnp.argsort(-estimate, axis=-1)  # descending
        nu = jax.vmap(lambda v, o, a=axis: jnp.take(v, o, axis=a))(nu, order)
        basis = jnp.take_along_axis(basis, order[:, None, :], axis=-1)
        power = jnp.einsum("bij,bjm->bim", stat, basis)
        new.append(_one_at_a_time(lambda m: jnp.linalg.qr(m)[0], power))
    return (new[0], new[1]), nu


def _as_batch(x: Array, matrix: bool) -> Matrix:
    """A matrix array as (batch, m, n); any other array as (1, 1, size)."""
    return x.reshape(-1, *x.shape[-2:]) if matrix else x.reshape(1, 1, -1)


def _leaf_init(
    matrix: bool, param: Array | optax.MaskedNode, max_dim: int
) -> SoapLeaf | optax.MaskedNode:
    if isinstance(param, optax.MaskedNode):
        return param
    zeros = jnp.zeros_like(param)
    if not matrix:
        return SoapLeaf(zeros, zeros, (None, None), (None, None))
    *batch, m, n = param.shape

    def square(d: int) -> Array | None:
        return jnp.zeros((*batch, d, d), param.dtype) if d <= max_dim else None

    sides = (square(m), square(n))
    return SoapLeaf(zeros, zeros, sides, sides)


def _stacked(side: Side) -> Side:
    """A side's arrays as (batch, d, d)."""
    return tuple(None if s is None else s.reshape(-1, *s.shape[-2:]) for s in side)


def _unstacked(side: Side, like: Side) -> Side:
    return tuple(None if s is None else s.reshape(r.shape) for s, r in zip(side, like, strict=True))


def scale_by_soap(
    matrices,
    *,
    b1: float,
    b2: float,
    eps: float,
    shampoo_beta: float,
    precondition_frequency: int,
    max_precond_dim: int,
) -> optax.GradientTransformation:
    """SOAP's direction u (bias-corrected, before the learning rate), zero on the first call.

    `matrices`: a tree of bools shaped like the parameters (None at frozen arrays), True where
    the last two axes are a matrix to precondition."""

    def init(params):
        leaves = jax.tree.map(lambda m, p: _leaf_init(m, p, max_precond_dim), matrices, params)
        return SoapState(jnp.zeros([], jnp.int32), leaves)

    def first(grads, state: SoapState):
        """Accumulate the statistics, take their eigenbases, move nothing."""

        def leaf(matrix, g, s):
            if isinstance(g, optax.MaskedNode) or not matrix:
                return s
            stats = _accumulate(_stacked(s.stats), _as_batch(g, True), shampoo_beta)
            bases = tuple(_eigenbasis(x) for x in stats)
            return s._replace(stats=_unstacked(stats, s.stats), bases=_unstacked(bases, s.bases))

        leaves = _map(leaf, matrices, grads, state.leaves)
        return jax.tree.map(jnp.zeros_like, grads), leaves

    def later(grads, state: SoapState):
        t = state.count.astype(jnp.result_type(float))
        correction = jnp.sqrt(1 - b2**t) / (1 - b1**t)
        refresh = state.count % precondition_frequency == 0

        def leaf(matrix, g, s):
            if isinstance(g, optax.MaskedNode):
                return g, s
            bases, stats = _stacked(s.bases), _stacked(s.stats)
            g3 = _as_batch(g, matrix)
            mu = b1 * _as_batch(s.mu, matrix) + (1 - b1) * _project(g3, bases)
            nu = b2 * _as_batch(s.nu, matrix) + (1 - b2) * jnp.square(_project(g3, bases))
            u = _project_back(mu / (jnp.sqrt(nu) + eps), bases) * correction
            if matrix:
                stats = _accumulate(stats, g3, shampoo_beta)

                def rotate(operands):
                    mu, nu = operands
                    new_bases, nu = _refresh(stats, bases, nu)
                    return _project(_project_back(mu, bases), new_bases), nu, new_bases

                mu, nu, bases = jax.lax.cond(refresh, rotate, lambda o: (*o, bases), (mu, nu))
            new = SoapLeaf(
                mu.reshape(g.shape),
                nu.reshape(g.shape),
                _unstacked(stats, s.stats),
                _unstacked(bases, s.bases),
            )
            return u.reshape(g.shape).astype(g.dtype), new

        pairs = _map(lambda m, g, s: _Pair(*leaf(m, g, s)), matrices, grads, state.leaves)
        is_pair = lambda x: isinstance(x, _Pair)  # noqa: E731
        updates = jax.tree.map(lambda p: p.update, pairs, is_leaf=is_pair)
        leaves = jax.tree.map(lambda p: p.state, pairs, is_leaf=is_pair)
        return updates, leaves

    def update(grads, state: SoapState, params=None):
        del params
        updates, leaves = jax.lax.cond(state.count == 0, first, later, grads, state)
        return updates, SoapState(optax.safe_increment(state.count), leaves)

    return optax.GradientTransformation(init, update)


class _Pair:
    """An update and a leaf's state, kept together (not a pytree) while the tree is split."""

    def __init__(self, update, state):
        self.update, self.state = update, state


def _map(fn: Callable, matrices, grads, leaves):
    """`fn(matrix, grad, leaf_state)` at every array: `matrices` gives the structure, so a
    masked array (optax.MaskedNode in grads and state) reaches `fn` whole."""
    is_state = lambda x: isinstance(x, SoapLeaf | optax.MaskedNode)  # noqa: E731
    flat, treedef = jax.tree.flatten(matrices)
    g_flat = treedef.flatten_up_to(grads)
    s_flat = jax.tree.flatten(leaves, is_leaf=is_state)[0]
    return jax.tree.unflatten(treedef, [fn(*a) for a in zip(flat, g_flat, s_flat, strict=True)])


def soap(
    learning_rate: optax.Schedule,
    matrices,
    *,
    b1: float,
    b2: float,
    eps: float,
    shampoo_beta: float,
    precondition_frequency: int,
    max_precond_dim: int,
    weight_decay: float,
    mask,
) -> optax.GradientTransformation:
    """SOAP with the reference's decoupled weight decay (after the step, on the arrays `mask`
    marks): w <- (w - lr(t) u) (1 - lr(t) wd); nothing moves on the first call. lr(t) is the
    schedule at the call's index (0 for the first)."""
    direction = scale_by_soap(
        matrices,
        b1=b1,
        b2=b2,
        eps=eps,
        shampoo_beta=shampoo_beta,
        precondition_frequency=precondition_frequency,
        max_precond_dim=max_precond_dim,
    )

    def update(grads, state, params):
        count = state.count
        u, state = direction.update(grads, state)
        lr = learning_rate(count)
        started = (count > 0).astype(jnp.result_type(float))

        def step(decays, u, p):
            if isinstance(u, optax.MaskedNode):
                return u
            moved = -lr * u
            if decays and weight_decay:
                moved = moved - started * lr * weight_decay * (p + moved)
            return moved.astype(p.dtype)

        return jax.tree.map(step, mask, u, params), state

    return optax.GradientTransformation(direction.init, update)

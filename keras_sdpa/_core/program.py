"""The core's compiled program: one XLA program per `Plan`, and its entry, `run_request`.

`run_request` turns a `Request` into a `Plan` (`plan.make`), then runs `compiled`, a
`tf.function(jit_compile=True)` on TensorFlow and a `jax.jit` on JAX keyed by the plan (inside a
caller's XLA step, traced into it). The program, `attention`, puts the queries in the grouped
layout and runs one path: `dense.py` (the whole `(T, S)` matrix), `chunked.py` (the online
softmax in blocks) or `decode.py` (a few rows against a cache), each taking
`(q, k, v, plan, tensors)`. The scores, bias, cap, masks, softmax and weighted sum run as one
XLA program, and so does their gradient.
"""

import typing

from keras import ops

from keras_sdpa import _backend
from keras_sdpa._core import chunked, decode, dense, layout, mod_calls, ring
from keras_sdpa._core import plan as plans
from keras_sdpa._core import request as requests
from keras_sdpa._mods import base as mod_base
from keras_sdpa._shared.types import MaskMod, Tensor


@_backend.do_not_convert
def run_request(query, key, value, mask=None, bias=None, request=requests.DEFAULT):
    """`scaled_dot_product_attention` with its options in one `requests.Request`, which
    may also hold the layer's two choices besides them: `flash_attention` (`True` chunked,
    `False` dense, `None` leaves it to `implementation`) and `cached` (a call against a
    key/value cache: one query row runs the decode path), decided with the rest of the call
    in `plans.make`.
    """
    _backend.check()
    if request.context_parallel is not None:  # the sequence sharded: its own program
        return ring.run(query, key, value, mask, bias, request)
    query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
    plan, call = plans.make(query, key, value, mask, bias, request)
    empty = empty_result(query, key, value, plan.return_weights)
    if empty is not None:
        return empty if plan.return_weights else empty[0]
    inputs = (query, key, value, *call)
    if plan.by_size:
        # Lengths unknown while tracing (a Keras model's `Input((None, E))`, TensorFlow
        # only: JAX knows every shape): the actual sizes choose between the two compiled
        # programs, at run time. "auto" never returns weights: they force dense.
        plan = plan.replace(by_size=False)
        out = ops.cond(
            plans.chunked_by_size(plan, query, key),
            lambda: compiled(*inputs, plan=plan.replace(path="chunked"))[0],
            lambda: compiled(*inputs, plan=plan)[0],
        )
        weights = None
    else:
        out, weights = compiled(*inputs, plan=plan)
    # What the reshapes inside the program hide from the static shape, it states again.
    shim = _backend.get()
    out = shim.with_static_shape(out, (*query.shape[:3], value.shape[-1]))  # (B, T, N, Hv)
    if not plan.return_weights:
        return out
    weights = shim.with_static_shape(
        weights, (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    )
    return out, weights


def empty_result(query, key, value, return_weights):
    """Zeros for an empty batch or an empty query or key axis (known statically), else None.

    A serving batch can be empty; a query with no keys attends to nothing (zeros).
    """
    b, t, n, _ = query.shape
    s = key.shape[1]
    if 0 not in (b, t, s):
        return None
    if None in (b, t, n, s) or None in value.shape:
        return None  # the compiled program handles the sizes it sees at run time
    out = ops.zeros((b, t, n, value.shape[-1]), query.dtype)
    return out, ops.zeros((b, n, t, s), query.dtype)


class Tensors(typing.NamedTuple):
    """A call's tensors inside its program, in the paths' grouped layout."""

    mask: Tensor | None = None  # (B|1, K|1, G|1, T|1, S|1) booleans
    bias: Tensor | None = None  # (B|1, K|1, G|1, T|1, S|1) in the compute precision
    seed: Tensor | None = None  # (2,) int32, with dropout
    score_mod: mod_calls.ScoreMod | None = None  # the mod bound to this call's tensors
    params: tuple[Tensor, ...] = ()  # what the score_mod's gradient reaches
    mask_mod: MaskMod | None = None
    block_kinds: Tensor | None = None  # `(nq, nk)` int32, the chunked path's


def attention(
    query,
    key,
    value,
    mask,
    bias,
    seed,
    score_tensors=(),
    mask_tensors=(),
    block_kinds=None,
    variable_values=(),
    *,
    plan,
):
    """The whole computation, traced once per plan: the grouped layout, then the plan's path.

    `score_tensors` and `mask_tensors` are the mods' tensors of this call (`base.split`), and
    `variable_values` (JAX) the values of the variables the mods hold.
    """
    tensors = bound_tensors(
        plan, mask, bias, seed, score_tensors, mask_tensors, block_kinds, variable_values
    )
    if plan.operand:
        # The products take the half-precision operands and accumulate in float32; the
        # scale multiplies their float32 result, so it never rounds to the input's precision.
        q = ops.transpose(query, (0, 2, 1, 3))  # (B, N, T, H)
    else:
        # (Q K^T) * scale == (Q * scale) K^T: scaling the (T, H) queries is cheaper
        # than scaling the (T, S) logits, and is the same number.
        q = ops.transpose(ops.cast(query, plan.compute), (0, 2, 1, 3)) * plan.scale
    shape = ops.shape(q)
    q = ops.reshape(q, (shape[0], plan.num_kv_heads, plan.groups, shape[2], shape[3]))
    if plan.path == "decode":  # the keys and values as they lie: (B, S, K, H)
        out, weights = decode.attend(q, key, value, plan, tensors)
    else:
        k = ops.transpose(ops.cast(key, plan.operand or plan.compute), (0, 2, 1, 3))
        v = ops.transpose(ops.cast(value, plan.operand or plan.compute), (0, 2, 1, 3))
        path = dense if plan.path == "dense" else chunked  # k (B, K, S, H), v (B, K, S, Hv)
        out, weights = path.attend(q, k, v, plan, tensors)
    shape = ops.shape(out)  # (B, K, G, T, Hv)
    out = ops.reshape(out, (shape[0], plan.num_heads, shape[3], shape[4]))  # (B, N, T, Hv)
    out = ops.cast(ops.transpose(out, (0, 2, 1, 3)), plan.dtype)  # (B, T, N, Hv)
    if weights is not None:
        shape = ops.shape(weights)
        weights = ops.reshape(weights, (shape[0], plan.num_heads, shape[3], shape[4]))
        weights = ops.cast(weights, plan.dtype)  # (B, N, T, S)
    return out, weights


def bound_tensors(
    plan, mask, bias, seed, score_tensors, mask_tensors, block_kinds, variable_values
):
    """The call's tensors as the paths read them: grouped masks and bias, and the mods bound
    to this call's tensors and (JAX) its variables' values."""
    score_template = None if plan.score_mod is None else plan.score_mod.mod
    mask_template = None if plan.mask_mod is None else plan.mask_mod.mod
    scope = ()
    if variable_values:  # JAX: the mods read their variables as this call's values
        scope = tuple(zip(mod_base.variables_of(score_template, mask_template), variable_values))
    # The score_mod's float tensors get gradients, and so do the variables it reads: on
    # TensorFlow through tf.custom_gradient's own tracking, on JAX as their values (`scope`).
    # (A tensor a plain function captures is a constant to the paths' custom gradients:
    # `mods.with_tensors` passes it as a tensor of its own.)
    score_mod = mod_calls.ScoreMod(score_template, score_tensors, scope)
    mask_mod = mod_base.as_function(mod_base.join(mask_template, mask_tensors))
    groups = (plan.num_kv_heads, plan.groups)
    if bias is not None:
        bias = layout.grouped(ops.cast(bias, plan.compute), plan.bias_pattern, *groups)
    return Tensors(
        mask=layout.grouped(mask, plan.mask_pattern, *groups),  # (B|1, K|1, G|1, T|1, S|1)
        bias=bias,
        seed=seed,
        score_mod=score_mod if score_mod.fn is not None else None,
        params=score_mod.params if score_mod.fn is not None else (),
        mask_mod=None if mask_mod is None else mod_calls.reading(mask_mod, scope),
        block_kinds=block_kinds,
    )


# The compiled program, one per plan (and per input shapes and dtypes): a
# `tf.function(jit_compile=True)` without AutoGraph, or a `jax.jit`.
compiled = _backend.compile(attention, static_argnames=("plan",))

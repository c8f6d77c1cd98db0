"""Inputs of any rank: the layer's `(B, *dims, ...)` tensors to the core's `(B', T, ...)`.

`keras.layers.MultiHeadAttention` attends over `attention_axes` and treats the other position
axes as batch axes. The core attends over one axis, so the attention axes are flattened into
`T` (and `S`) and the others into the batch `B'`, and the outputs, masks, biases and weights are
moved between the two layouts here. For rank-3 inputs every step is the identity.
"""

import functools
import operator

import keras


def normalize_axes(attention_axes, rank):
    """Attention axes of an input of `rank`, as positive ints (MHA's negative-axis rule)."""
    if attention_axes is None:
        return tuple(range(1, rank - 1))
    axes = tuple(axis if axis >= 0 else rank + axis for axis in attention_axes)
    for axis in axes:
        if not 1 <= axis <= rank - 2:
            raise ValueError(
                f"`attention_axes` must name position axes of the inputs, 1 to {rank - 2} "
                f"(or negative ones) for inputs of rank {rank}. "
                f"Received: attention_axes={attention_axes}"
            )
    if len(set(axes)) != len(axes):
        raise ValueError(
            f"`attention_axes` must not repeat an axis. Received: attention_axes={attention_axes}"
        )
    return axes


class Flattener:
    """Moves between the layer's `(B, *dims, …)` tensors and the core's `(B', T, …)`.

    The attention axes are flattened into `T` (and `S`), the other position axes
    into the batch `B'`, as `keras.layers.MultiHeadAttention`'s einsums read them.
    For rank-3 inputs every step is the identity.
    """

    def __init__(self, rank, axes, query_shape, value_shape):
        """`query_shape` and `value_shape` are those of the projected tensors, as
        `keras.ops.shape` gives them: ints where known, scalar tensors where not."""
        self.rank = rank
        self.axes = axes
        self.batch_axes = [a for a in range(1, rank - 1) if a not in axes]
        self.trivial = rank == 3
        self.query_shape, self.value_shape = query_shape, value_shape
        # Projected tensors have rank + 1 axes: (B, *dims, heads, size).
        self.order = [0] + self.batch_axes + list(axes) + [rank - 1, rank]
        self.inverse = [self.order.index(a) for a in range(rank + 1)]

    def _sizes(self, shape, axes):
        """The product of `shape` over `axes`: an int where every size is known."""
        return functools.reduce(operator.mul, [shape[a] for a in axes], 1)

    def inputs(self, x, which):
        """`(B, *dims, heads, size)` to `(B', L, heads, size)`."""
        if self.trivial:
            return x
        shape = self.query_shape if which == "query" else self.value_shape
        x = keras.ops.transpose(x, self.order)  # (B, *batch dims, *attention dims, heads, size)
        heads, size = keras.ops.shape(x)[-2:]
        batch = shape[0] * self._sizes(shape, self.batch_axes)
        length = self._sizes(shape, self.axes)
        return keras.ops.reshape(x, (batch, length, heads, size))

    def outputs(self, out):
        """`(B', T, N, Hv)` back to `(B, *dims_q, N, Hv)`."""
        if self.trivial:
            return out
        shape = self.query_shape
        out_shape = keras.ops.shape(out)
        sizes = [shape[0]] + [shape[a] for a in self.batch_axes] + [shape[a] for a in self.axes]
        out = keras.ops.reshape(out, (*sizes, out_shape[-2], out_shape[-1]))
        return keras.ops.transpose(out, self.inverse)

    def scores(self, x, num_heads, name):
        """A mask or bias in MHA's scores layout to the core's `(B'|1, N|1, T|1, S|1)`.

        Rank 3: `(T, S)`, `(B, T, S)` gain a head axis; `(B, N|1, T, S)` passes.
        Higher ranks: MHA's layout `(B, *batch dims, N, *query axes, *key axes)`,
        with or without the head axis, broadcast and flattened.
        """
        full_rank = 1 + len(self.batch_axes) + 1 + 2 * len(self.axes)
        if len(x.shape) > full_rank:
            raise ValueError(
                f"`{name}` must have rank {full_rank} or less (the scores' layout "
                f"{'(B, N, T, S)' if self.trivial else '(B, *batch, N, *T, *S)'}). "
                f"Received: {name}.shape={tuple(x.shape)}"
            )
        while len(x.shape) < full_rank:  # the head axis first, then the leading ones
            x = keras.ops.expand_dims(x, -2 * len(self.axes) - 1)
        if self.trivial:
            return x
        heads = x.shape[1 + len(self.batch_axes)]
        q, v = self.query_shape, self.value_shape
        heads = num_heads if heads != 1 else 1
        target = (
            [q[0]]
            + [q[a] for a in self.batch_axes]
            + [heads]
            + [q[a] for a in self.axes]
            + [v[a] for a in self.axes]
        )
        x = keras.ops.broadcast_to(x, target)  # (B, *batch dims, N|1, *query axes, *key axes)
        batch = q[0] * self._sizes(q, self.batch_axes)
        t, s = self._sizes(q, self.axes), self._sizes(v, self.axes)
        return keras.ops.reshape(x, (batch, heads, t, s))

    def bias(self, x, num_heads):
        """An additive bias to the core's `(B'|1, N|1, T|1, S|1)`, broadcast by NumPy's rules.

        Unlike a mask (MHA reads a rank-3 mask as `(B, T, S)`), a bias of lower rank gains
        leading axes: `(N, T, S)` (ALiBi's, T5's), `(T, S)` and `(S,)` broadcast as NumPy
        broadcasts them to `(B, N, T, S)`, as `keras_sdpa.scaled_dot_product_attention` does.
        """
        full_rank = 1 + len(self.batch_axes) + 1 + 2 * len(self.axes)
        while len(x.shape) < full_rank:
            x = keras.ops.expand_dims(x, 0)
        return self.scores(x, num_heads, "attention_bias")

    def weights(self, weights):
        """`(B', N, T, S)` to MHA's `(B, *batch dims, N, *query axes, *key axes)`."""
        if self.trivial:
            return weights
        q, v = self.query_shape, self.value_shape
        w_shape = keras.ops.shape(weights)
        sizes = (
            [q[0]]
            + [q[a] for a in self.batch_axes]
            + [w_shape[1]]
            + [q[a] for a in self.axes]
            + [v[a] for a in self.axes]
        )
        return keras.ops.reshape(weights, sizes)

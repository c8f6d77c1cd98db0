"""`ScaledDotProductAttention`: the Keras layer that owns W_Q, W_K, W_V (and W_O)."""

import keras
import tensorflow as tf

from keras_sdpa import ops


@keras.saving.register_keras_serializable(package="keras_sdpa")
class ScaledDotProductAttention(keras.layers.Layer):
    """Scaled dot-product attention with learned projections.

        Q = X_q W_Q,  K = X_k W_K,  V = X_v W_V
        Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

    (Vaswani et al., 2017, "Attention Is All You Need", section 3.2.) With
    `num_heads > 1` each head attends on its own `key_dim`-wide slice and the
    heads are concatenated and projected by `W_O`, exactly as in
    `keras.layers.MultiHeadAttention`. This layer is a drop-in replacement for
    it: the same argument names, the same call signature, and the same weights
    in the same order, so `layer.set_weights(mha.get_weights())` copies a Keras
    layer into this one.

    The attention itself runs in `keras_sdpa.ops.scaled_dot_product_attention`,
    one XLA-compiled program (`tf.function(jit_compile=True)`) for the forward
    pass and one for the gradient. Scores and softmax are computed in float32,
    also under mixed precision. A query that may attend to no key (all of its
    keys masked) gets zero weights and a zero attention output, never NaN.

    Args:
        num_heads: number of attention heads `N`. Defaults to 1, the single
            head of the derivation.
        key_dim: size `H` of each head for query and key. Defaults to the
            query width divided by `num_heads`.
        value_dim: size `Hv` of each head for value. Defaults to `key_dim`.
        dropout: dropout rate on the attention weights, in `[0, 1)`.
        use_bias: whether the projections have biases.
        output_shape: width of the output. Defaults to the query width.
        output_projection: whether to apply `W_O`. Defaults to `True` when
            `num_heads > 1` or `output_shape` is set, as in
            `keras.layers.MultiHeadAttention`. A single head without it returns
            `softmax(Q K^T / sqrt(d_k)) V` itself, of width `value_dim`.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: as for `keras.layers.Dense`, applied to every
            projection.
        seed: seed for the attention dropout. Under a `tf.distribute` strategy
            each replica draws its own masks from it.
        implementation: `"auto"` (default), `"dense"` or `"chunked"`: the path of
            `keras_sdpa.ops.scaled_dot_product_attention`. Chunked runs in
            `O(T + S)` memory; `"auto"` picks it when the float32 scores would
            exceed 256 MiB. Dropout while training and `return_attention_scores`
            always run dense. Results agree to float32 round-off.
        chunk_size: block size of the chunked path (default 2048).
        scale: multiplies the scores `Q K^T`. Defaults to `1 / sqrt(key_dim)`,
            the derivation's scaling; `scale=1.0` turns it off (see "The math,
            verified" in the README for what that costs).

    Call arguments:
        query: `(B, T, E_q)` query input.
        value: `(B, S, E_v)` value input.
        key: optional `(B, S, E_k)` key input; defaults to `value`.
        attention_mask: optional boolean `(B, T, S)` mask; `True` may attend.
        return_attention_scores: if `True`, also return the attention weights
            `(B, N, T, S)` (before dropout).
        training: whether dropout is active.
        use_causal_mask: if `True`, query `t` attends only to keys `s <= t`.
        query_mask, value_mask, key_mask: `(B, T)` / `(B, S)` padding masks.
            Keras fills them from the inputs' implicit masks, for example from
            `keras.layers.Embedding(mask_zero=True)`.

    Returns:
        `(B, T, output_shape)`, and the weights `(B, N, T, S)` if
        `return_attention_scores`.

    Example:

    >>> layer = ScaledDotProductAttention(num_heads=2, key_dim=8)
    >>> x = tf.random.normal((4, 10, 16))  # (B, T, E)
    >>> y, weights = layer(x, x, return_attention_scores=True)
    >>> y.shape, weights.shape
    (TensorShape([4, 10, 16]), TensorShape([4, 2, 10, 10]))
    """

    def __init__(
        self,
        num_heads=1,
        key_dim=None,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        output_shape=None,
        output_projection=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        seed=None,
        implementation="auto",
        chunk_size=None,
        scale=None,
        **kwargs,
    ):
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(
                f"`num_heads` must be a positive integer. Received: num_heads={num_heads}"
            )
        for name, size in (("key_dim", key_dim), ("value_dim", value_dim)):
            if size is not None and (not isinstance(size, int) or size <= 0):
                raise ValueError(
                    f"`{name}` must be a positive integer or None. Received: {name}={size}"
                )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1). Received: dropout={dropout}")
        if isinstance(output_shape, (tuple, list)):
            if len(output_shape) != 1:
                raise ValueError(
                    "`output_shape` must be an int or a 1-tuple. "
                    f"Received: output_shape={output_shape}"
                )
            output_shape = output_shape[0]
        if output_shape is not None and (not isinstance(output_shape, int) or output_shape <= 0):
            raise ValueError(
                "`output_shape` must be a positive integer or None. "
                f"Received: output_shape={output_shape}"
            )
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim
        self.dropout = dropout
        self.use_bias = use_bias
        self.output_shape = output_shape
        self.output_projection = output_projection
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        if implementation not in ("auto", "dense", "chunked"):
            raise ValueError(
                '`implementation` must be "auto", "dense" or "chunked". '
                f"Received: implementation={implementation!r}"
            )
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
            raise ValueError(
                "`chunk_size` must be a positive integer or None. "
                f"Received: chunk_size={chunk_size}"
            )
        if scale is not None:
            ops._check_scale(scale)
            scale = float(scale)
        self.scale = scale
        self.seed = seed
        self.implementation = implementation
        self.chunk_size = chunk_size
        self.seed_generator = keras.random.SeedGenerator(seed) if dropout > 0 else None
        self.supports_masking = True

    @property
    def uses_output_projection(self):
        if self.output_projection is not None:
            return bool(self.output_projection)
        return self.num_heads > 1 or self.output_shape is not None

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        shapes = {"query": query_shape, "value": value_shape, "key": key_shape}
        for name, shape in shapes.items():
            _check_rank(name, shape)
        query_width, value_width, key_width = (shapes[n][-1] for n in ("query", "value", "key"))
        if self.key_dim is None and query_width % self.num_heads:
            raise ValueError(
                "With `key_dim=None` the query width must divide by `num_heads`. "
                f"Received: query width={query_width}, num_heads={self.num_heads}"
            )
        self._key_dim = self.key_dim or query_width // self.num_heads
        self._value_dim = self.value_dim or self._key_dim
        heads = self.num_heads

        self.query_kernel, self.query_bias = self._projection(
            "query", query_width, heads, self._key_dim
        )
        self.key_kernel, self.key_bias = self._projection("key", key_width, heads, self._key_dim)
        self.value_kernel, self.value_bias = self._projection(
            "value", value_width, heads, self._value_dim
        )
        if self.uses_output_projection:
            out_width = self.output_shape or query_width
            self.output_kernel = self._weight(
                "output_kernel", (heads, self._value_dim, out_width), kernel=True
            )
            self.output_bias = (
                self._weight("output_bias", (out_width,), kernel=False) if self.use_bias else None
            )

    def _projection(self, name, width, heads, size):
        kernel = self._weight(f"{name}_kernel", (width, heads, size), kernel=True)
        bias = self._weight(f"{name}_bias", (heads, size), kernel=False) if self.use_bias else None
        return kernel, bias

    def _weight(self, name, shape, kernel):
        return self.add_weight(
            name=name,
            shape=shape,
            initializer=self.kernel_initializer if kernel else self.bias_initializer,
            regularizer=self.kernel_regularizer if kernel else self.bias_regularizer,
            constraint=self.kernel_constraint if kernel else self.bias_constraint,
        )

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
    ):
        key = value if key is None else key
        self._check_call_inputs(query, value, key)
        # Also checks that key and value have the same length S.
        out_width = self.compute_output_shape(query.shape, value.shape, key.shape)[-1]

        q = _project(query, self.query_kernel, self.query_bias)  # (B, T, N, H)
        k = _project(key, self.key_kernel, self.key_bias)  # (B, S, N, H)
        v = _project(value, self.value_kernel, self.value_bias)  # (B, S, N, Hv)

        mask = _combine_masks(query_mask, value_mask, key_mask, attention_mask)
        if mask is not None:
            mask = tf.expand_dims(mask, 1)  # (B, 1, T, S)
        seed = None
        if training and self.dropout > 0:
            seed = _per_replica(self.seed_generator.next())
        result = ops.scaled_dot_product_attention(
            q,
            k,
            v,
            mask,
            is_causal=use_causal_mask,
            scale=self.scale,
            dropout_rate=self.dropout,
            training=bool(training),
            seed=seed,
            return_weights=return_attention_scores,
            implementation=self.implementation,
            chunk_size=self.chunk_size,
        )
        out, weights = result if return_attention_scores else (result, None)

        shape = tf.shape(out)
        width = self.num_heads * self._value_dim
        out = tf.reshape(out, (-1, width))  # (B * T, N * Hv): the heads, concatenated
        if self.uses_output_projection:
            kernel = tf.reshape(self.output_kernel, (width, -1))  # (N * Hv, E_out)
            out = tf.matmul(out, kernel)  # (B * T, E_out)
            if self.output_bias is not None:
                out = out + self.output_bias
        out = tf.reshape(out, tf.concat([shape[:2], [-1]], 0))  # (B, T, E_out or N * Hv)
        out.set_shape([None, None, out_width])
        if return_attention_scores:
            return out, weights
        return out

    def _check_call_inputs(self, query, value, key):
        for name, tensor, kernel in (
            ("query", query, self.query_kernel),
            ("value", value, self.value_kernel),
            ("key", key, self.key_kernel),
        ):
            if not tensor.dtype.is_floating:
                raise ValueError(
                    f"`{name}` must be a floating tensor. "
                    f"Received: {name}.dtype={tensor.dtype.name}"
                )
            _check_rank(name, tensor.shape)
            if tensor.shape[-1] is not None and tensor.shape[-1] != kernel.shape[0]:
                raise ValueError(
                    f"The last axis of `{name}` must be {kernel.shape[0]}, the width "
                    f"this layer was built with. Received: {name}.shape={tuple(tensor.shape)}"
                )

    def compute_mask(self, query, previous_mask=None):
        # Keras passes the mask of the first input, the query's: each output
        # position is one query position, so it carries on unchanged.
        return previous_mask

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        query_shape = tuple(query_shape)
        value_shape = tuple(value_shape)
        key_shape = value_shape if key_shape is None else tuple(key_shape)
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            _check_rank(name, shape)
        if None not in (key_shape[1], value_shape[1]) and key_shape[1] != value_shape[1]:
            raise ValueError(
                "`key` and `value` must have the same length S (axis 1). "
                f"Received: key_shape={key_shape}, value_shape={value_shape}"
            )
        if self.uses_output_projection:
            width = self.output_shape or query_shape[-1]
        else:
            key_dim = self.key_dim or query_shape[-1] // self.num_heads
            width = self.num_heads * (self.value_dim or key_dim)
        return query_shape[:-1] + (width,)

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
    ):
        key_shape = None if key is None else key.shape
        shape = self.compute_output_shape(query.shape, value.shape, key_shape)
        out = keras.KerasTensor(shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return out
        # (B, N, T, S): T from the query, S from the value, also in cross-attention.
        scores_shape = (query.shape[0], self.num_heads, query.shape[1], value.shape[1])
        return out, keras.KerasTensor(scores_shape, dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "dropout": self.dropout,
                "use_bias": self.use_bias,
                "output_shape": self.output_shape,
                "output_projection": self.output_projection,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
                "activity_regularizer": keras.regularizers.serialize(self.activity_regularizer),
                "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
                "bias_constraint": keras.constraints.serialize(self.bias_constraint),
                "seed": self.seed,
                "implementation": self.implementation,
                "chunk_size": self.chunk_size,
                "scale": self.scale,
            }
        )
        return config


def _per_replica(seed):
    """A `(2,)` seed made distinct for each replica of a `tf.distribute` strategy.

    The seed generator's state is a mirrored variable that every replica advances
    alike, so without this all replicas would drop the same attention weights.
    Outside a strategy (one replica) the seed is unchanged.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return seed
    replica = tf.cast(context.replica_id_in_sync_group, seed.dtype)
    return seed + tf.stack([replica * 1_000_003, tf.zeros_like(replica)])


def _project(x, kernel, bias):
    y = tf.einsum("bte,enh->btnh", x, kernel)  # (B, T, N, H)
    return y if bias is None else y + bias


def _combine_masks(query_mask, value_mask, key_mask, attention_mask):
    """The `(B, T, S)` boolean mask of `keras.layers.MultiHeadAttention`, or None."""
    mask = None
    if query_mask is not None:
        mask = tf.expand_dims(tf.cast(query_mask, tf.bool), -1)  # (B, T, 1)
    for padding in (value_mask, key_mask):
        if padding is not None:
            padding = tf.expand_dims(tf.cast(padding, tf.bool), -2)  # (B, 1, S)
            mask = padding if mask is None else tf.logical_and(mask, padding)
    if attention_mask is not None:
        attention_mask = tf.cast(attention_mask, tf.bool)
        if attention_mask.shape.rank != 3:
            raise ValueError(
                "`attention_mask` must have rank 3, (B, T, S). "
                f"Received: attention_mask.shape={tuple(attention_mask.shape)}"
            )
        mask = attention_mask if mask is None else tf.logical_and(mask, attention_mask)
    return mask


def _check_rank(name, shape):
    if len(shape) != 3:
        raise ValueError(
            f"`{name}` must have rank 3, (batch, length, width). "
            f"Received: {name}.shape={tuple(shape)}"
        )

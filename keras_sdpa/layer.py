"""`ScaledDotProductAttention`: the Keras layer that owns W_Q, W_K, W_V (and W_O)."""

import string

import keras

from keras_sdpa import _arguments, _backend, _cache, _folded, _layer_masks, _rank_n, mods, ops
from keras_sdpa import _stand_in as stand_in


@keras.saving.register_keras_serializable(package="keras_sdpa")
class ScaledDotProductAttention(keras.layers.Layer):
    """Scaled dot-product attention with learned projections.

        Q = X_q W_Q,  K = X_k W_K,  V = X_v W_V
        Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

    (Vaswani et al., 2017, "Attention Is All You Need", section 3.2.) With
    `num_heads > 1` each head attends on its own `key_dim`-wide slice and the
    heads are concatenated and projected by `W_O`, exactly as in
    `keras.layers.MultiHeadAttention`. This layer is a drop-in replacement for
    it and for `keras.layers.GroupQueryAttention`: the same arguments in the
    same order, the same call signature, and the same weights in the same
    order, so `layer.set_weights(mha.get_weights())` copies a Keras layer into
    this one. The projections are `keras.layers.EinsumDense` sublayers named as
    in Keras, so `enable_lora`, `quantize("int8")` and dtype-policy maps reach
    them.

    The attention itself runs in `keras_sdpa.ops.scaled_dot_product_attention`,
    one XLA-compiled program (`tf.function(jit_compile=True)` on TensorFlow,
    `jax.jit` on JAX) for the forward pass and one for the gradient. Scores and
    softmax are computed in float32, also under mixed precision. A query that
    may attend to no key (all of its keys masked) gets zero weights and a zero
    attention output, never NaN.

    Beyond Keras's layers: an additive `attention_bias` (ALiBi, T5 relative
    positions) with its gradient, `attn_logits_soft_cap`, a `scale` of your
    choice, the `O(T)`-memory chunked path (`flash_attention=True`) with
    dropout, window and grouped heads on it, and inputs of any rank on every
    path.

    Args:
        num_heads: number of query heads `N`. Defaults to 1, the single head
            of the derivation.
        key_dim: size `H` of each head for query and key. Defaults to the
            query width divided by `num_heads`.
        value_dim: size `Hv` of each head for value. Defaults to `key_dim`.
        dropout: dropout rate on the attention weights, in `[0, 1)`.
        use_bias: whether the projections have biases.
        output_shape: the output's trailing shape, an int or a tuple (for
            example `(8, 8)`). Defaults to the query width.
        attention_axes: the axes of the inputs `(B, *dims, E)` that attention
            runs over, as in `keras.layers.MultiHeadAttention`; the others are
            batch axes. Defaults to all of `dims`.
        sliding_window: optional positive int `W`: query `t` sees keys with
            `|t - s| < W`; with `use_causal_mask`, the causal band (Mistral).
        flash_attention: `True` runs the chunked `O(T)`-memory path, `False`
            the dense path, `None` (default) lets `implementation` decide.
        kernel_initializer: as for `keras.layers.EinsumDense`, applied to every
            projection; so are `bias_initializer`, `kernel_regularizer`,
            `bias_regularizer`, `activity_regularizer`, `kernel_constraint`
            and `bias_constraint`.
        use_gate: gated attention (Qiu et al., 2025): each head's output is
            multiplied by a sigmoid of its own projection of the query before
            `W_O`, as in `keras.layers.MultiHeadAttention(use_gate=True)`.
        seed: seed for the attention dropout. Under a `tf.distribute` strategy
            each replica draws its own masks from it; on JAX a sharded program
            draws one mask for the whole batch.
        num_key_value_heads: number `K` of key/value heads, dividing
            `num_heads` (grouped-query attention; 1 is multi-query). Defaults
            to `num_heads`. Keys and values are never repeated to `N` heads.
        output_projection: whether to apply `W_O`. Defaults to `True` when
            `num_heads > 1` or `output_shape` is set. A single head without it
            returns `softmax(Q K^T / sqrt(d_k)) V` itself, of width `value_dim`.
        implementation: `"auto"` (default), `"dense"` or `"chunked"`: the path
            of `keras_sdpa.ops.scaled_dot_product_attention`. `"auto"` picks
            chunked when the float32 scores would exceed 256 MiB, from the
            actual sizes, also when the lengths are unknown until run time.
            `return_attention_scores` always runs dense.
        chunk_size: block size of the chunked path (default 2048; with a
            `sliding_window` of `W`, the power of two at or above `W / 2`; 512 with
            `use_causal_mask` or a `mask_mod`; without a window or a `mask_mod`, a
            default size is evened out over lengths known while tracing).
        scale: multiplies the scores `Q K^T`. Defaults to `1 / sqrt(key_dim)`.
        attn_logits_soft_cap: optional positive float `cap`: the logits become
            `cap * tanh(logits / cap)` before the softmax (Gemma 2).
        score_mod: optional `score_mod(score, b, h, q_idx, kv_idx) -> score` (PyTorch
            FlexAttention's argument order), applied to the scaled logits before
            `attention_bias`: a built-in of `keras_sdpa.mods` (ALiBi, T5 buckets, soft
            cap) or your own function. A mod that owns weights (the T5 table) is a
            sublayer: its weights are this layer's, after the projections'.
        mask_mod: optional `mask_mod(b, h, q_idx, kv_idx) -> bool`, True meaning "may
            attend", combined with the other masks (causal, document, prefix-LM,
            chunked-local). On the chunked path the blocks it empties are skipped.
            Built-ins and functions registered with
            `keras.saving.register_keras_serializable` round-trip through `get_config`
            and `.keras` files; an unregistered function cannot be saved.
        replaces: None, or the class this layer stands in for (`"MultiHeadAttention"`,
            `"GroupedQueryAttention"`, `"CachedMultiHeadAttention"`), as the swap sets
            it: the layer then takes that class's call arguments, and gives a fully
            masked query what that class gives (`keras_sdpa._stand_in`).

    Call arguments:
        query: `(B, *dims_q, E_q)` query input; rank 3 is `(B, T, E_q)`.
        value: `(B, *dims_v, E_v)` value input.
        key: optional `(B, *dims_v, E_k)` key input; defaults to `value`.
        attention_mask: optional boolean mask, `True` may attend:
            `(T, S)`, `(B, T, S)`, `(B, 1, T, S)` or per head `(B, N, T, S)`
            (for higher ranks, MHA's layout without or with the head axis).
        attention_bias: optional float tensor broadcastable to the scores
            `(B, N, T, S)` (for rank 3), added to the scaled logits before the
            soft cap and the masks. Gradients flow into it.
        return_attention_scores: if `True`, also return the attention weights
            (before dropout), `(B, N, T, S)` for rank-3 inputs.
        training: whether dropout is active.
        use_causal_mask: if `True`, query `t` attends only to keys `s <= t`.
        query_mask, value_mask, key_mask: `(B, T)` / `(B, S)` padding masks.
            Keras fills them from the inputs' implicit masks, for example from
            `keras.layers.Embedding(mask_zero=True)`.
        segment_ids: optional `(B, T)` integer ids of packed sequences, for a
            `keras_sdpa.mods.document()` mask mod built without ids (self-attention,
            so the keys' length is `T` too). With a `cache`, `(B, S)`: one id per cached
            position. Sizes known while tracing are checked; inside a program whose
            shapes are unknown, an id past the end is clamped by XLA.
        cache: optional key/value cache `(B, 2, S, K, H)` for generation, with
            keras-hub's `CachedMultiHeadAttention` contract: without
            `cache_update_index` the cached keys and values are used and the inputs'
            ignored; with it, the new keys and values are written there first. The call
            then returns `(out, cache)`, or `(out, scores, cache)`.
        cache_update_index: where the new keys and values go: an int, or a `(B,)`
            integer tensor with one position per row (rows of different lengths). Query
            `i` of row `b` sits at `index[b] + i`: `use_causal_mask`, the window and the
            mods count from there, so keys past a row's position are never read. Each
            index must be in `[0, S - T]`: checked for ints and eager tensors, and when a
            graph runs; inside an XLA program (`jit_compile=True`) asserts are dropped
            and a write past the end of the cache is lost.

    Returns:
        `(B, *dims_q, *output_shape)`, and the weights if
        `return_attention_scores`.

    Example:

    >>> layer = ScaledDotProductAttention(num_heads=4, key_dim=8, num_key_value_heads=2)
    >>> x = keras.random.normal((4, 10, 16))  # (B, T, E)
    >>> y, weights = layer(x, x, return_attention_scores=True, use_causal_mask=True)
    >>> tuple(y.shape), tuple(weights.shape)
    ((4, 10, 16), (4, 4, 10, 10))
    """

    def __init__(
        self,
        num_heads=1,
        key_dim=None,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        output_shape=None,
        attention_axes=None,
        sliding_window=None,
        flash_attention=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        use_gate=False,
        seed=None,
        num_key_value_heads=None,
        output_projection=None,
        implementation="auto",
        chunk_size=None,
        scale=None,
        attn_logits_soft_cap=None,
        score_mod=None,
        mask_mod=None,
        replaces=None,
        **kwargs,
    ):
        # As in MultiHeadAttention, the activity regularizer applies to every projection's
        # output, not to the layer's.
        super().__init__(**kwargs)
        self._activity_regularizer = keras.regularizers.get(activity_regularizer)
        _backend.check()
        stand_in.check(replaces, use_gate, sliding_window)
        self._replaces = replaces
        if replaces is not None:
            self._call_signature = stand_in.call_signature(self.call, replaces)
            self.call_signature_parameters = list(self._call_signature.parameters)
        self.output_shape, attention_axes, scale = _arguments.check(
            num_heads, key_dim, value_dim, num_key_value_heads, dropout, output_shape,
            attention_axes, sliding_window, flash_attention, implementation, chunk_size, scale,
            attn_logits_soft_cap, score_mod, mask_mod,
        )  # fmt: skip
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim
        self.dropout = dropout
        self.use_bias = use_bias
        self.attention_axes = attention_axes
        self.sliding_window = sliding_window
        self.flash_attention = flash_attention
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.use_gate = use_gate
        self.seed = seed
        self.num_key_value_heads = num_key_value_heads
        self.output_projection = output_projection
        self.implementation = implementation
        self.chunk_size = chunk_size
        self.scale = scale
        self.attn_logits_soft_cap = attn_logits_soft_cap
        # Not tracked here: a mod that owns weights (the T5 table) is tracked at the end of
        # `build`, so that its weights follow the projections' and
        # `set_weights(mha.get_weights() + [table])` reads in MultiHeadAttention's order.
        object.__setattr__(self, "score_mod", score_mod)
        object.__setattr__(self, "mask_mod", mask_mod)
        self.seed_generator = keras.random.SeedGenerator(seed) if dropout > 0 else None
        self.supports_masking = True

    @property
    def replaces(self):
        """The class this layer stands in for (set at construction), or None."""
        return self._replaces

    def __call__(self, *args, **kwargs):
        if self._replaces is not None:  # bound by the replaced class's call, in its order
            args, kwargs = stand_in.by_name(self._call_signature, args, kwargs)
        return super().__call__(*args, **kwargs)

    @property
    def uses_output_projection(self):
        if self.output_projection is not None:
            return bool(self.output_projection)
        return self.num_heads > 1 or self.output_shape is not None

    @property
    def path(self):
        """The core's `implementation`, after `flash_attention`."""
        if self.flash_attention is None:
            return self.implementation
        return "chunked" if self.flash_attention else "dense"

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        query_shape, value_shape, key_shape = (
            tuple(shape) for shape in (query_shape, value_shape, key_shape)
        )
        self._check_shapes(query_shape, value_shape, key_shape)
        query_width = query_shape[-1]
        if self.key_dim is None and query_width % self.num_heads:
            raise ValueError(
                "With `key_dim=None` the query width must divide by `num_heads`. "
                f"Received: query width={query_width}, num_heads={self.num_heads}"
            )
        self._key_dim = self.key_dim or query_width // self.num_heads
        self._value_dim = self.value_dim or self._key_dim
        self._kv_heads = self.num_key_value_heads or self.num_heads
        rank = len(query_shape)

        heads, kv_heads = self.num_heads, self._kv_heads
        # Built in MultiHeadAttention's order: query, key, gate, value, output.
        self._query_dense = self._projection("query", query_shape, (heads, self._key_dim))
        self._key_dense = self._projection("key", key_shape, (kv_heads, self._key_dim))
        if self.use_gate:
            self._gate_dense = self._projection(
                "gate", query_shape, (heads, self._value_dim), activation="sigmoid"
            )
        self._value_dense = self._projection("value", value_shape, (kv_heads, self._value_dim))
        self._output_dense = None
        if self.uses_output_projection:
            out_shape = self.output_shape or (query_width,)
            equation, bias_axes = _projection_equation(rank - 1, 2, len(out_shape))
            self._output_dense = keras.layers.EinsumDense(
                equation,
                output_shape=(None,) * (rank - 2) + tuple(out_shape),
                bias_axes=bias_axes if self.use_bias else None,
                name="attention_output",
                **self._sublayer_kwargs(),
            )
            self._output_dense.build(query_shape[:-1] + (heads, self._value_dim))
        self._mod_layers = [
            mod for mod in (self.score_mod, self.mask_mod) if isinstance(mod, keras.layers.Layer)
        ]

    def _projection(self, name, input_shape, heads_and_size, activation=None):
        rank = len(input_shape)
        equation, bias_axes = _projection_equation(rank - 1, 1, 2)
        dense = keras.layers.EinsumDense(
            equation,
            output_shape=(None,) * (rank - 2) + tuple(heads_and_size),
            bias_axes=bias_axes if self.use_bias else None,
            activation=activation,
            name=name,
            **self._sublayer_kwargs(),
        )
        dense.build(input_shape)
        return dense

    def _sublayer_kwargs(self):
        # A fresh initializer per projection, so that seeded initializers do not
        # give every projection the same kernel.
        def fresh(initializer):
            return initializer.__class__.from_config(initializer.get_config())

        return dict(
            kernel_initializer=fresh(self.kernel_initializer),
            bias_initializer=fresh(self.bias_initializer),
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            activity_regularizer=self._activity_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            dtype=self.dtype_policy,
        )

    @property
    def query_dense(self):
        return self._query_dense

    @property
    def key_dense(self):
        return self._key_dense

    @property
    def value_dense(self):
        return self._value_dense

    @property
    def output_dense(self):
        return self._output_dense

    # W_Q, W_K, W_V, W_O by the names of the derivation.
    query_kernel = property(lambda self: self._query_dense.kernel)
    key_kernel = property(lambda self: self._key_dense.kernel)
    value_kernel = property(lambda self: self._value_dense.kernel)
    output_kernel = property(lambda self: self._output_dense.kernel)

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        attention_bias=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        segment_ids=None,
        cache=None,
        cache_update_index=None,
    ):
        key = value if key is None else key
        query_mask = stand_in.query_mask(self.replaces, query, query_mask)
        self._check_call_inputs(query, value, key)
        mask_mod = _layer_masks.bind_segment_ids(self.mask_mod, segment_ids, query, key, cache)
        if cache is not None or cache_update_index is not None:
            return self._call_cached(
                query, value, key, query_mask, value_mask, key_mask, attention_mask,
                attention_bias, return_attention_scores, use_causal_mask, mask_mod, cache,
                cache_update_index, training,
            )  # fmt: skip
        if return_attention_scores and self.flash_attention:
            raise ValueError(
                "`return_attention_scores=True` needs the whole (T, S) matrix, which "
                "`flash_attention=True` never forms. Received: flash_attention=True, "
                "return_attention_scores=True"
            )
        rank = len(query.shape)
        own_core = self._own_core
        # The query's padding masks whole rows: the core gets the key-side masks only, and those
        # rows are zeroed after it (the same numbers; a (B, S) mask costs the core 0.88x the
        # time of a (B, T, S) one, forward plus backward, at the app's B=64, T=512).
        rows = query_mask if own_core and rank == 3 else None
        mask = _layer_masks.combine_masks(
            None if rows is not None else query_mask, value_mask, key_mask, attention_mask, rank
        )
        with _layer_masks.masks_set_aside(query, value, key):
            gate = self._gate_dense(query) if self.use_gate else None  # (B, *dims_q, N, Hv)
            if self._folds_projections(query, training, use_causal_mask):
                out, weights = self._attend_in_input_space(
                    query, value, key, mask, training, return_attention_scores,
                    use_causal_mask, attention_bias,
                )  # fmt: skip
                out, weights = _layer_masks.zero_rows(out, weights, rows)
                out = stand_in.rows(
                    self, out, value, lambda: _folded.mean_values(self, value), mask, rows,
                    return_attention_scores, use_causal_mask,
                )  # fmt: skip
                return self._finish(query, out, weights, gate, return_attention_scores)
            q = self._query_dense(query)  # (B, *dims_q, N, H)
            k = self._key_dense(key)  # (B, *dims_v, K, H)
            v = self._value_dense(value)  # (B, *dims_v, K, Hv)
        if own_core:
            out, weights = self._compute_attention(
                q,
                k,
                v,
                mask,
                training,
                return_attention_scores,
                use_causal_mask=use_causal_mask,
                attention_bias=attention_bias,
                mask_mod=mask_mod,
            )
            out, weights = _layer_masks.zero_rows(out, weights, rows)
            out = stand_in.rows(
                self, out, value, lambda: keras.ops.mean(v, axis=1, keepdims=True), mask, rows,
                return_attention_scores, use_causal_mask,
            )  # fmt: skip
        else:
            # A subclass that overrides MultiHeadAttention's `_compute_attention`
            # gets MHA's contract: the causal mask folded into `attention_mask`.
            if self.score_mod is not None or self.mask_mod is not None:
                raise ValueError(
                    "`score_mod` and `mask_mod` reach only this layer's own "
                    f"`_compute_attention`; {type(self).__name__} overrides it. Received: "
                    f"score_mod={self.score_mod!r}, mask_mod={self.mask_mod!r}"
                )
            if attention_bias is not None:
                raise ValueError(
                    "`attention_bias` reaches only this layer's own `_compute_attention`; "
                    f"{type(self).__name__} overrides it. Received: attention_bias with shape "
                    f"{tuple(attention_bias.shape)}"
                )
            if use_causal_mask:
                t, s = keras.ops.shape(query)[1], keras.ops.shape(value)[1]
                causal = _layer_masks.causal_mask(t, s)  # (1, T, S)
                mask = causal if mask is None else keras.ops.logical_and(mask, causal)
            out, weights = self._compute_attention(q, k, v, mask, training, return_attention_scores)
        return self._finish(query, out, weights, gate, return_attention_scores)

    def _call_cached(
        self, query, value, key, query_mask, value_mask, key_mask, attention_mask,
        attention_bias, return_attention_scores, use_causal_mask, mask_mod, cache, index,
        training,
    ):  # fmt: skip
        """keras-hub's `CachedMultiHeadAttention` contract, with per-row positions.

        `cache` is `(B, 2, S, K, H)`: the projected keys and values of `S` positions. Without
        `cache_update_index` it is read as it is (the inputs' keys and values are ignored);
        with it, the new keys and values are written at that position (an int for every row,
        or a `(B,)` tensor, one per row) and the updated cache is returned. Query `i` of row
        `b` sits at position `index[b] + i`: a causal mask, a window and the mods count from
        there (bottom-right alignment), so keys past a row's position are never read.
        With `training` and a `dropout`, the attention weights are dropped as in the
        uncached call.
        """
        if not self._own_core:
            raise ValueError(
                f"A `cache` reaches only this layer's own attention; {type(self).__name__} "
                "overrides `_compute_attention`."
            )
        cache = _cache.check(
            cache, index, query, value_mask, key_mask, self._kv_heads, self._key_dim,
            self._value_dim,
        )  # fmt: skip
        q = self._query_dense(query)  # (B, T, N, H)
        keys, values, offset, cache = _cache.update(  # (B, S, K, H) twice, (B,), the cache
            cache, index, key, lambda: (self._key_dense(key), self._value_dense(value))
        )
        # The core sees the score mod only inside the positioned wrapper, whose head count it
        # cannot read: checked here, for a score mod set after the layer was made too.
        mods.check_heads(self.score_mod, self.num_heads)
        positioned = _cache.Positioned(
            offset, bool(use_causal_mask), self.sliding_window, mask_mod, self.score_mod
        )
        mask = None
        if attention_mask is not None:
            mask = _layer_masks.as_bool(attention_mask)
            mask = mask[:, None] if len(mask.shape) == 3 else mask  # (B, 1|N, T, S)
        bias = None
        if attention_bias is not None:
            bias = keras.ops.cast(attention_bias, self.compute_dtype)
        seed = None
        if training and self.dropout > 0:  # dropout as in the uncached call (keras-hub's too)
            seed = _backend.get().per_replica(self.seed_generator.next())
        result = ops.scaled_dot_product_attention(
            q,
            keras.ops.cast(keys, q.dtype),
            keras.ops.cast(values, q.dtype),
            mask,
            bias=bias,
            attn_logits_soft_cap=self.attn_logits_soft_cap,
            scale=self.scale,
            dropout_rate=self.dropout,
            training=bool(training),
            seed=seed,
            return_weights=return_attention_scores,
            # One new token against the cache: the core's decode path reads the cache in its
            # (B, S, K, H) layout, where the others would transpose a copy of it every token.
            implementation="decode" if self.path == "auto" and query.shape[1] == 1 else self.path,
            chunk_size=self.chunk_size,
            score_mod=positioned.score_mod(),
            mask_mod=positioned.mask_mod(),
        )
        out, weights = result if return_attention_scores else (result, None)
        out, weights = _layer_masks.zero_rows(out, weights, query_mask)
        out = stand_in.cached_rows(self, out, values, mask, return_attention_scores)
        gate = self._gate_dense(query) if self.use_gate else None
        out = self._finish(query, out, weights, gate, return_attention_scores)
        if return_attention_scores:
            return out[0], out[1], cache
        return out, cache

    def _finish(self, query, out, weights, gate, return_attention_scores):
        """The gate and `W_O` on the heads' outputs `(B, *dims_q, N, Hv)`."""
        if gate is not None:
            out = out * gate
        if self._output_dense is not None:
            out = self._output_dense(out)  # (B, *dims_q, *output_shape)
        else:
            width = self.num_heads * self._value_dim
            out = keras.ops.reshape(out, (*keras.ops.shape(out)[:-2], width))  # heads concatenated
            out = _backend.get().with_static_shape(out, (*query.shape[:-1], width))
        if return_attention_scores:
            return out, weights
        return out

    @property
    def _own_core(self):
        """Whether attention runs in this class's `_compute_attention` (not a subclass's)."""
        return type(self)._compute_attention is ScaledDotProductAttention._compute_attention

    def _folds_projections(self, query, training, use_causal_mask):
        """Whether a short query attends in the inputs' space (`keras_sdpa._folded`)."""
        return self._own_core and _folded.folds(self, query, training, use_causal_mask)

    def _attend_in_input_space(
        self, query, value, key, mask, training, return_attention_scores, use_causal_mask,
        attention_bias,
    ):  # fmt: skip
        return _folded.attend(
            self, query, value, key, mask, training, return_attention_scores, use_causal_mask,
            attention_bias,
        )  # fmt: skip

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
        attention_bias=None,
        mask_mod=None,
    ):
        """Attention on projected tensors, MultiHeadAttention's override point.

        Args:
            query: `(B, *dims_q, N, H)` projected queries.
            key: `(B, *dims_v, K, H)` projected keys.
            value: `(B, *dims_v, K, Hv)` projected values.
            attention_mask: boolean mask in MHA's layout, or None.
            training: whether dropout is active.
            return_attention_scores: whether to return the weights.
            use_causal_mask: the causal constraint, applied inside the core.
            attention_bias: additive bias in the scores' layout, or None.
            mask_mod: the mask mod of this call (with its segment ids); defaults to
                the layer's.

        Returns:
            `(B, *dims_q, N, Hv)` and the weights in MHA's layout (or None).
        """
        query, key, value = (keras.ops.convert_to_tensor(x) for x in (query, key, value))
        rank = len(query.shape) - 1  # the inputs' rank
        axes = _rank_n.normalize_axes(self.attention_axes, rank)
        query_shape, value_shape = keras.ops.shape(query), keras.ops.shape(value)
        # The core sees (B', T, N, H): non-attention axes join the batch.
        flat = _rank_n.Flattener(rank, axes, query_shape, value_shape)
        q, k, v = (
            flat.inputs(query, "query"),
            flat.inputs(key, "value"),
            flat.inputs(value, "value"),
        )
        mask = None
        if attention_mask is not None:
            mask = _layer_masks.as_bool(attention_mask)
            mask = flat.scores(mask, self.num_heads, "attention_mask")  # (B', N|1, T, S)
        bias = None
        if attention_bias is not None:
            attention_bias = keras.ops.convert_to_tensor(attention_bias)
            if keras.backend.is_float_dtype(attention_bias.dtype):
                attention_bias = keras.ops.cast(attention_bias, self.compute_dtype)
            bias = flat.scores(attention_bias, self.num_heads, "attention_bias")
        seed = None
        if training and self.dropout > 0:
            seed = _backend.get().per_replica(self.seed_generator.next())
        result = ops.scaled_dot_product_attention(
            q,
            k,
            v,
            mask,
            bias=bias,
            is_causal=use_causal_mask,
            sliding_window=self.sliding_window,
            attn_logits_soft_cap=self.attn_logits_soft_cap,
            scale=self.scale,
            dropout_rate=self.dropout,
            training=bool(training),
            seed=seed,
            return_weights=return_attention_scores,
            implementation=self.path,
            chunk_size=self.chunk_size,
            score_mod=self.score_mod,
            mask_mod=self.mask_mod if mask_mod is None else mask_mod,
        )
        out, weights = result if return_attention_scores else (result, None)
        out = flat.outputs(out)  # (B, *dims_q, N, Hv)
        out = _backend.get().with_static_shape(out, (*query.shape[:-1], value.shape[-1]))
        if weights is not None:
            weights = flat.weights(weights)
        return out, weights

    def _check_call_inputs(self, query, value, key):
        for name, tensor, dense in (
            ("query", query, self._query_dense),
            ("value", value, self._value_dense),
            ("key", key, self._key_dense),
        ):
            dtype = keras.backend.standardize_dtype(tensor.dtype)
            if not keras.backend.is_float_dtype(dtype):
                raise ValueError(
                    f"`{name}` must be a floating tensor. Received: {name}.dtype={dtype}"
                )
            width = dense.kernel.shape[0]
            if tensor.shape[-1] is not None and tensor.shape[-1] != width:
                raise ValueError(
                    f"The last axis of `{name}` must be {width}, the width "
                    f"this layer was built with. Received: {name}.shape={tuple(tensor.shape)}"
                )
        self._check_shapes(tuple(query.shape), tuple(value.shape), tuple(key.shape))

    def _check_shapes(self, query_shape, value_shape, key_shape):
        _arguments.check_shapes(self.attention_axes, query_shape, value_shape, key_shape)

    def compute_mask(self, query, previous_mask=None):
        # Keras passes the mask of the first input, the query's: each output
        # position is one query position, so it carries on unchanged.
        return previous_mask

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        query_shape = tuple(query_shape)
        value_shape = tuple(value_shape)
        key_shape = value_shape if key_shape is None else tuple(key_shape)
        if value_shape[1:-1] != key_shape[1:-1]:
            raise ValueError(
                "All dimensions of `value` and `key`, except the last one, must be equal. "
                f"Received: value_shape={value_shape}, key_shape={key_shape}"
            )
        if self.uses_output_projection:
            return query_shape[:-1] + (self.output_shape or (query_shape[-1],))
        key_dim = self.key_dim or query_shape[-1] // self.num_heads
        return query_shape[:-1] + (self.num_heads * (self.value_dim or key_dim),)

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        attention_bias=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        segment_ids=None,
        cache=None,
        cache_update_index=None,
    ):
        key_shape = None if key is None else key.shape
        shape = self.compute_output_shape(query.shape, value.shape, key_shape)
        out = keras.KerasTensor(shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return out
        # MHA's layout: (B, *batch dims, N, *query attention dims, *key attention dims).
        rank = len(query.shape)
        axes = _rank_n.normalize_axes(self.attention_axes, rank)
        batch = [query.shape[a] for a in range(1, rank - 1) if a not in axes]
        scores_shape = (
            (query.shape[0], *batch, self.num_heads)
            + tuple(query.shape[a] for a in axes)
            + tuple(value.shape[a] for a in axes)
        )
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
                "attention_axes": self.attention_axes,
                "sliding_window": self.sliding_window,
                "flash_attention": self.flash_attention,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
                "activity_regularizer": keras.regularizers.serialize(self._activity_regularizer),
                "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
                "bias_constraint": keras.constraints.serialize(self.bias_constraint),
                "use_gate": self.use_gate,
                "seed": self.seed,
                "num_key_value_heads": self.num_key_value_heads,
                "output_projection": self.output_projection,
                "implementation": self.implementation,
                "chunk_size": self.chunk_size,
                "scale": self.scale,
                "attn_logits_soft_cap": self.attn_logits_soft_cap,
                "score_mod": _arguments.serialize_mod("score_mod", self.score_mod),
                "mask_mod": _arguments.serialize_mod("mask_mod", self.mask_mod),
                "replaces": self.replaces,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for name in ("score_mod", "mask_mod"):
            if config.get(name) is not None:
                config[name] = keras.saving.deserialize_keras_object(config[name])
        return cls(**config)


def _projection_equation(free_dims, bound_dims, output_dims):
    """An EinsumDense equation `(free…, bound…) x (bound…, out…) -> (free…, out…)`.

    Returns the equation and the bias axes (the output axes).
    """
    letters = iter(string.ascii_lowercase)
    free = "".join(next(letters) for _ in range(free_dims))
    bound = "".join(next(letters) for _ in range(bound_dims))
    out = "".join(next(letters) for _ in range(output_dims))
    return f"{free}{bound},{bound}{out}->{free}{out}", out

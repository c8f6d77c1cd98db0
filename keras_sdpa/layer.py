"""`ScaledDotProductAttention`: the Keras layer that owns W_Q, W_K, W_V (and W_O).

The layer projects, caches and calls; the rest is in its room, `keras_sdpa/_layer/`: `call`
(its call by route), `arguments` (checks, config), `shapes` (projections' equations, output
shapes), `rank_n` (inputs of any rank), `masks`, `cache` (the key/value cache), `folded` (a
short query in the inputs' space), `stand_in` (the class it replaces). The core's program,
`keras_sdpa._core.program.run_request`, picks the path.
"""

import keras

from keras_sdpa import _backend
from keras_sdpa._core import program
from keras_sdpa._core import request as _request
from keras_sdpa._layer import arguments as _arguments
from keras_sdpa._layer import call as _layer_call
from keras_sdpa._layer import masks as _layer_masks
from keras_sdpa._layer import rank_n, stand_in
from keras_sdpa._layer import shapes as _shapes
from keras_sdpa._shared.types import MaskMod, ScoreMod, Tensor


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
    in Keras. The attention runs in `keras_sdpa.ops`, XLA-compiled; docs/layer.md
    says what the layer adds to Keras's.

    Args:
        num_heads: number of query heads `N`. Defaults to 1.
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
        use_gate: gated attention (Qiu et al., 2025), as in
            `keras.layers.MultiHeadAttention(use_gate=True)`.
        seed: seed for the attention dropout.
        num_key_value_heads: number `K` of key/value heads, dividing
            `num_heads` (grouped-query attention; 1 is multi-query). Defaults
            to `num_heads`.
        output_projection: whether to apply `W_O`. Defaults to `True` when
            `num_heads > 1` or `output_shape` is set.
        implementation: `"auto"` (default), `"dense"` or `"chunked"`: the path
            of `keras_sdpa.ops.scaled_dot_product_attention`; "auto" goes chunked
            when the float32 scores would pass 256 MiB (docs/core.md).
        chunk_size: block size of the chunked path; defaults as in the core's.
        scale: multiplies the scores `Q K^T`. Defaults to `1 / sqrt(key_dim)`.
        attn_logits_soft_cap: optional positive float `cap`: the logits become
            `cap * tanh(logits / cap)` before the softmax (Gemma 2).
        score_mod: optional `score_mod(score, b, h, q_idx, kv_idx) -> score`,
            applied to the scaled logits before `attention_bias` (`keras_sdpa.mods`).
        mask_mod: optional `mask_mod(b, h, q_idx, kv_idx) -> bool`, True meaning
            "may attend", combined with the other masks (saved if registered).
        context_parallel: optional name of an axis of the active
            `keras.distribution`'s device mesh (JAX backend): the sequence is
            sharded over it and attention runs as a ring
            (`keras_sdpa.ops.scaled_dot_product_attention`, docs/context-parallel.md).
        replaces: None, or the class this layer stands in for, as the swap sets
            it (`keras_sdpa._layer.stand_in`).

    Call arguments:
        query: `(B, *dims_q, E_q)` query input; rank 3 is `(B, T, E_q)`.
        value: `(B, *dims_v, E_v)` value input.
        key: optional `(B, *dims_v, E_k)` key input; defaults to `value`.
        attention_mask: optional boolean mask, `True` may attend:
            `(T, S)`, `(B, T, S)`, `(B, 1, T, S)` or per head `(B, N, T, S)`
            (for higher ranks, MHA's layout without or with the head axis).
        attention_bias: optional float tensor broadcastable to the scores `(B, N, T, S)`
            (rank 3) by NumPy's rules, added to the scaled logits in float32.
        return_attention_scores: if `True`, also return the attention weights
            (before dropout), `(B, N, T, S)` for rank-3 inputs.
        training: whether dropout is active.
        use_causal_mask: if `True`, query `t` attends only to keys `s <= t`.
        query_mask, value_mask, key_mask: `(B, T)` / `(B, S)` padding masks.
        segment_ids: optional `(B, T)` integer ids of packed sequences, for a
            `keras_sdpa.mods.document()` mask mod (with a `cache`, `(B, S)`).
        cache: optional key/value cache `(B, 2, S, K, H)` for generation, with
            keras-hub's `CachedMultiHeadAttention` contract; the call then
            returns `(out, cache)`, or `(out, scores, cache)`.
        cache_update_index: where the new keys and values go: an int, or a
            `(B,)` tensor with one position per row.

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

    @_arguments.plain_numbers
    def __init__(
        self,
        num_heads: int = 1,
        key_dim: int | None = None,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        output_shape: int | tuple[int, ...] | None = None,
        attention_axes: int | tuple[int, ...] | None = None,
        sliding_window: int | None = None,
        flash_attention: bool | None = None,
        kernel_initializer: str | keras.initializers.Initializer = "glorot_uniform",
        bias_initializer: str | keras.initializers.Initializer = "zeros",
        kernel_regularizer: str | keras.regularizers.Regularizer | None = None,
        bias_regularizer: str | keras.regularizers.Regularizer | None = None,
        activity_regularizer: str | keras.regularizers.Regularizer | None = None,
        kernel_constraint: str | keras.constraints.Constraint | None = None,
        bias_constraint: str | keras.constraints.Constraint | None = None,
        use_gate: bool = False,
        seed: int | None = None,
        num_key_value_heads: int | None = None,
        output_projection: bool | None = None,
        implementation: str = "auto",
        chunk_size: int | None = None,
        scale: float | None = None,
        attn_logits_soft_cap: float | None = None,
        score_mod: ScoreMod | None = None,
        mask_mod: MaskMod | None = None,
        context_parallel: str | None = None,
        replaces: str | None = None,
        **kwargs,
    ):
        arguments = locals()  # by name: the core's options are listed once, in `_arguments.CORE`
        super().__init__(**kwargs)
        # Each projection's, not the layer's own, as in MultiHeadAttention.
        self._activity_regularizer = keras.regularizers.get(activity_regularizer)
        _backend.check()
        stand_in.check(replaces, use_gate, sliding_window)
        self._replaces = replaces
        if replaces is not None:
            self._call_signature = stand_in.call_signature(self.call, replaces)
            self.call_signature_parameters = list(self._call_signature.parameters)
        core = {name: arguments[name] for name in _arguments.CORE}  # what it passes on
        self.output_shape, attention_axes = _arguments.check(
            num_heads,
            key_dim,
            value_dim,
            num_key_value_heads,
            dropout,
            output_shape,
            attention_axes,
            core,
        )
        self.num_heads, self.key_dim, self.value_dim = num_heads, key_dim, value_dim
        self.dropout, self.use_bias = dropout, use_bias
        self.attention_axes, self.sliding_window = attention_axes, sliding_window
        self.flash_attention, self.attn_logits_soft_cap = flash_attention, attn_logits_soft_cap
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.use_gate, self.seed = use_gate, seed
        self.num_key_value_heads, self.output_projection = num_key_value_heads, output_projection
        self.implementation, self.chunk_size = implementation, chunk_size
        self.context_parallel = context_parallel
        self.scale = None if scale is None else float(scale)
        # Untracked: a mod's weights (the T5 table) are tracked at the end of `build`, after the
        # projections', so `set_weights(mha.get_weights() + [table])` reads in MHA's order.
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
        kwargs = _arguments.bias_past_autocast(self, ScaledDotProductAttention, args, kwargs)
        return super().__call__(*args, **kwargs)

    @property
    def uses_output_projection(self):
        if self.output_projection is not None:
            return bool(self.output_projection)
        return self.num_heads > 1 or self.output_shape is not None

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        query_shape, value_shape, key_shape = (
            tuple(shape) for shape in (query_shape, value_shape, key_shape)
        )
        _arguments.check_shapes(self.attention_axes, query_shape, value_shape, key_shape)
        query_width = query_shape[-1]
        if self.key_dim is None and query_width % self.num_heads:
            raise ValueError(
                "With `key_dim=None` the query width must divide by `num_heads`. "
                f"Received: query width={query_width}, num_heads={self.num_heads}"
            )
        self._key_dim = self.key_dim or query_width // self.num_heads
        self._value_dim = self.value_dim or self._key_dim
        self._kv_heads = self.num_key_value_heads or self.num_heads
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
        if self.uses_output_projection:  # (B, *dims_q, N, Hv) to (B, *dims_q, *output_shape)
            heads_shape = query_shape[:-1] + (heads, self._value_dim)
            out_shape = self.output_shape or (query_width,)
            self._output_dense = self._projection("attention_output", heads_shape, out_shape, 2)
        self._mod_layers = [
            mod for mod in (self.score_mod, self.mask_mod) if isinstance(mod, keras.layers.Layer)
        ]

    def _projection(self, name, input_shape, output_shape, bound_dims=1, activation=None):
        """A built `EinsumDense` of this layer's settings (`keras_sdpa._layer.shapes.einsum_dense`).

        A fresh initializer per projection, so that seeded initializers do not give every
        projection the same kernel."""
        adopted = getattr(self, "_adopted_projections", lambda name: None)  # the swap's
        if adopted(name) is not None:
            return adopted(name)  # the replaced layer's own (LoRA, quantized) sublayer

        def fresh(initializer):
            return initializer.__class__.from_config(initializer.get_config())

        return _shapes.einsum_dense(
            name,
            input_shape,
            output_shape,
            bound_dims,
            self.use_bias,
            activation=activation,
            kernel_initializer=fresh(self.kernel_initializer),
            bias_initializer=fresh(self.bias_initializer),
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            activity_regularizer=self._activity_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            dtype=self.dtype_policy,
        )

    # The projections, by MultiHeadAttention's names and by the derivation's: W_Q, W_K, ...
    query_dense = property(lambda self: self._query_dense)
    key_dense = property(lambda self: self._key_dense)
    value_dense = property(lambda self: self._value_dense)
    output_dense = property(lambda self: self._output_dense)
    query_kernel = property(lambda self: self._query_dense.kernel)
    key_kernel = property(lambda self: self._key_dense.kernel)
    value_kernel = property(lambda self: self._value_dense.kernel)
    output_kernel = property(lambda self: self._output_dense.kernel)

    def call(
        self,
        query: Tensor,
        value: Tensor,
        key: Tensor | None = None,
        query_mask: Tensor | None = None,
        value_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
        attention_bias: Tensor | None = None,
        return_attention_scores: bool = False,
        training: bool | None = None,
        use_causal_mask: bool = False,
        segment_ids: Tensor | None = None,
        cache: Tensor | None = None,
        cache_update_index: int | Tensor | None = None,
    ) -> Tensor | tuple[Tensor, ...]:
        key = value if key is None else key
        projections = (self._query_dense, self._value_dense, self._key_dense)
        widths = [dense.kernel.shape[0] for dense in projections]  # the inputs' widths
        _arguments.check_call_inputs(query, value, key, widths, self.attention_axes)
        call = _layer_call.Call(
            query,
            value,
            key,
            masks=(stand_in.query_mask(self.replaces, query, query_mask), value_mask, key_mask),
            attention_mask=attention_mask,
            attention_bias=_arguments.bias_value(attention_bias),
            return_scores=return_attention_scores,
            training=training,
            causal=use_causal_mask,
            mask_mod=_layer_masks.bind_segment_ids(self.mask_mod, segment_ids, query, key, cache),
            cache=cache,
            index=cache_update_index,
        )
        with _layer_masks.masks_set_aside(query, value, key):
            attend = _layer_call.route(self, call)  # cached, overridden, folded or projected
            out, weights, cache = attend(self, call)  # (B, *dims_q, N, Hv), ...
            gate = self._gate_dense(query) if self.use_gate else None  # (B, *dims_q, N, Hv)
        out = self._finish(query, out, weights, gate, return_attention_scores)
        if cache is None:
            return out
        return (*out, cache) if return_attention_scores else (out, cache)

    def _core_request(self, training, return_attention_scores, **call_options):
        """This call's `keras_sdpa._core.request.Request`: the layer's settings as they are now,
        with a fresh dropout seed where dropout is active, and `call_options` (this call's
        causal mask, its mask mod)."""
        seed = None
        if training and self.dropout > 0:
            seed = _backend.get().per_replica(self.seed_generator.next())
        settings = {name: getattr(self, name) for name in _arguments.CORE}
        return _request.Request(
            **{**settings, **call_options},
            dropout_rate=self.dropout,
            training=bool(training),
            seed=seed,
            return_weights=return_attention_scores,
        )

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
        """Whether a short query attends in the inputs' space (`keras_sdpa._layer.folded`)."""
        return _layer_call.folds(self, query, training, use_causal_mask)

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
            mask_mod: this call's mask mod (with its segment ids), else the layer's.

        Returns:
            `(B, *dims_q, N, Hv)` and the weights in MHA's layout (or None).
        """
        query, key, value = (keras.ops.convert_to_tensor(x) for x in (query, key, value))
        rank = len(query.shape) - 1  # the inputs' rank
        axes = rank_n.normalize_axes(self.attention_axes, rank)
        # The core sees (B', T, N, H): non-attention axes join the batch.
        flat = rank_n.Flattener(rank, axes, keras.ops.shape(query), keras.ops.shape(value))
        mask = _layer_masks.to_core(attention_mask, flat, self.num_heads)  # (B', N|1, T, S)
        bias = None  # in its own precision: the core adds it to float32 logits
        if attention_bias is not None:
            attention_bias = keras.ops.convert_to_tensor(attention_bias)
            bias = flat.bias(attention_bias, self.num_heads)  # (B'|1, N|1, T|1, S|1)
        request = self._core_request(
            training,
            return_attention_scores,
            is_causal=use_causal_mask,
            mask_mod=self.mask_mod if mask_mod is None else mask_mod,
        )
        result = program.run_request(
            flat.inputs(query, "query"),
            flat.inputs(key, "value"),
            flat.inputs(value, "value"),
            mask,
            bias,
            request,
        )
        out, weights = result if return_attention_scores else (result, None)
        out = flat.outputs(out)  # (B, *dims_q, N, Hv)
        out = _backend.get().with_static_shape(out, (*query.shape[:-1], value.shape[-1]))
        return out, None if weights is None else flat.weights(weights)

    def compute_mask(self, query, previous_mask=None):
        # Keras passes the mask of the first input, the query's: each output
        # position is one query position, so it carries on unchanged.
        return previous_mask

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        return _shapes.output_shape(
            query_shape,
            value_shape,
            key_shape,
            self.uses_output_projection,
            self.output_shape,
            self.num_heads,
            self.key_dim,
            self.value_dim,
        )

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
        shape = _shapes.scores_shape(query.shape, value.shape, self.attention_axes, self.num_heads)
        return out, keras.KerasTensor(shape, dtype=self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), **_arguments.config(self)}

    @classmethod
    def from_config(cls, config):
        return cls(**_arguments.from_config(config))

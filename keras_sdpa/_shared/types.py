"""The types the records of the package are written in: read these names in `Request`,
`Plan`, `CallTensors`, `Tensors`, the layer's `Call`, the chunked path's blocks and a family's
`Family`, before the code that fills them.

`Tensor` is a backend tensor: a `tf.Tensor` (or `tf.Variable`) on TensorFlow, a `jax.Array`
on JAX, or what `keras.ops.convert_to_tensor` takes (a NumPy array). The two backends share
no base class, so the alias names the idea rather than a class. The mods' callables are named
as PyTorch's FlexAttention names them (`_score_mod_signature`, `_mask_mod_signature`).
"""

from collections.abc import Callable
from typing import Any, TypeAlias

Tensor: TypeAlias = Any
"""A backend tensor, in the shapes of the package's glossary (`keras_sdpa.ops`)."""

ScoreMod: TypeAlias = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""`score_mod(score, b, h, q_idx, kv_idx) -> score`: changes each scaled logit."""

MaskMod: TypeAlias = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""`mask_mod(b, h, q_idx, kv_idx) -> bool`: whether query `q_idx` may attend to key
`kv_idx`."""

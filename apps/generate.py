"""A tiny causal language model on the layer's key/value cache, exported with a `generate`
signature that runs the whole cache loop inside the SavedModel.

Usage:
    python -m apps.generate --output saved_models/tiny_lm --steps 200
    python -m apps.generate --output saved_models/tiny_lm --text README.md --prompt "The "

It trains on the bytes of a text file (this repository's README by default) for a few steps,
prints a greedy continuation, and writes a SavedModel whose `generate(prompt, num_new)` takes
`(B, P)` int32 byte ids and an int32 count and returns `(B, P + num_new)` ids. It loads with
plain `tf.saved_model.load`, without this package.
"""

import argparse
import os
import sys

import keras
import numpy as np
import tensorflow as tf

from keras_sdpa import ScaledDotProductAttention

VOCAB = 256  # bytes


@keras.saving.register_keras_serializable(package="apps")
class TinyLM(keras.Model):
    """Byte embeddings, learned positions, one causal attention block and a byte classifier.

    `call(tokens)` is the training pass, `(B, T)` to logits `(B, T, 256)`. `step(tokens, cache,
    index)` runs `tokens` `(B, t)` at positions `index, ..., index + t - 1` against the
    key/value cache `(B, 2, max_length, N, H)` and returns their logits and the updated cache.
    """

    def __init__(self, max_length=128, width=64, num_heads=4, **kwargs):
        super().__init__(**kwargs)
        self.max_length, self.width, self.num_heads = max_length, width, num_heads
        self.embedding = keras.layers.Embedding(VOCAB, width)
        self.positions = keras.layers.Embedding(max_length, width)
        self.attention = ScaledDotProductAttention(num_heads=num_heads, key_dim=width // num_heads)
        self.norm = keras.layers.LayerNormalization()
        self.hidden = keras.layers.Dense(4 * width, activation="gelu")
        self.project = keras.layers.Dense(width)
        self.logits = keras.layers.Dense(VOCAB)

    def _embed(self, tokens, start):
        positions = start[:, None] + tf.range(tf.shape(tokens)[1])[None, :]  # (B, t)
        return self.embedding(tokens) + self.positions(positions)  # (B, t, E)

    def _head(self, x, attended):
        x = self.norm(x + attended)
        return self.logits(x + self.project(self.hidden(x)))  # (B, t, 256)

    def call(self, tokens):
        x = self._embed(tokens, tf.zeros(tf.shape(tokens)[:1], tf.int32))
        return self._head(x, self.attention(x, x, use_causal_mask=True))

    def step(self, tokens, cache, index):
        x = self._embed(tokens, index)
        attended, cache = self.attention(
            x, x, use_causal_mask=True, cache=cache, cache_update_index=index
        )
        return self._head(x, attended), cache

    def empty_cache(self, batch):
        head = self.width // self.num_heads
        return tf.zeros(tf.stack([batch, 2, self.max_length, self.num_heads, head]))

    def get_config(self):
        config = super().get_config()
        config.update(max_length=self.max_length, width=self.width, num_heads=self.num_heads)
        return config


def generate(model, prompt, num_new):
    """Greedy decoding with the cache: the prompt in one step, then one token a step.

    `prompt` `(B, P)` int32 ids, `num_new` an int32 scalar; returns `(B, P + num_new)`. A
    `tf.while_loop`, so the loop itself lives in a traced (and exported) function.
    """
    prompt, num_new = _checked(model, prompt, num_new)
    batch, length = tf.shape(prompt)[0], tf.shape(prompt)[1]
    logits, cache = model.step(prompt, model.empty_cache(batch), tf.zeros([batch], tf.int32))
    first = tf.argmax(logits[:, -1], axis=-1, output_type=tf.int32)  # (B,)
    out = tf.TensorArray(tf.int32, size=num_new, element_shape=[None])

    def body(i, token, cache, out):
        out = out.write(i, token)
        logits, cache = model.step(token[:, None], cache, tf.fill([batch], length + i))
        return i + 1, tf.argmax(logits[:, -1], axis=-1, output_type=tf.int32), cache, out

    _, _, _, out = tf.while_loop(
        lambda i, *_: i < num_new, body, (tf.constant(0), first, cache, out)
    )
    new = tf.reshape(tf.transpose(out.stack()), tf.stack([batch, num_new]))  # (B, num_new)
    return tf.concat([prompt, new], axis=1)


def _checked(model, prompt, num_new):
    """`prompt` and `num_new` as tensors, with `1 <= num_new` and `P + num_new <= max_length`:
    past it the positions' embedding has no row and the cache no room. Checked now when the
    values are known (eager), else when the traced function runs."""
    prompt = tf.convert_to_tensor(prompt, tf.int32)
    num_new = tf.convert_to_tensor(num_new, tf.int32)
    limit = model.max_length
    if not tf.is_symbolic_tensor(prompt) and not tf.is_symbolic_tensor(num_new):
        new, length = int(num_new), int(prompt.shape[1])
        if length < 1:
            raise ValueError(
                "`prompt` must hold at least one token. "
                f"Received: prompt.shape={tuple(prompt.shape)}"
            )
        if new < 1 or length + new > limit:
            raise ValueError(
                f"`num_new` must be at least 1, and the prompt's {length} tokens plus `num_new` "
                f"at most the model's max_length={limit}. Received: num_new={new}"
            )
        return prompt, num_new
    message = (
        f"`prompt` must hold at least one token, `num_new` must be at least 1, and the prompt "
        f"plus `num_new` at most {limit}"
    )
    checks = [
        tf.debugging.assert_greater_equal(tf.shape(prompt)[1], 1, message=message),
        tf.debugging.assert_greater_equal(num_new, 1, message=message),
        tf.debugging.assert_less_equal(tf.shape(prompt)[1] + num_new, limit, message=message),
    ]
    with tf.control_dependencies(checks):
        return tf.identity(prompt), tf.identity(num_new)


def export_generate(model, path):
    """Writes a SavedModel with the `generate(prompt, num_new)` signature; returns `path`."""
    module = tf.Module()
    module.model = model

    @tf.function(
        input_signature=[
            tf.TensorSpec((None, None), tf.int32, name="prompt"),
            tf.TensorSpec((), tf.int32, name="num_new"),
        ]
    )
    def serve(prompt, num_new):
        return {"tokens": generate(model, prompt, num_new)}

    module.generate = serve
    tf.saved_model.save(module, path, signatures={"generate": serve})
    return path


def byte_windows(text, length, count, seed):
    """`count` random windows of `length + 1` bytes of `text`: inputs and next-byte targets."""
    data = np.frombuffer(text, np.uint8).astype("int32")
    starts = np.random.default_rng(seed).integers(0, len(data) - length - 1, count)
    windows = np.stack([data[s : s + length + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text", default="README.md", help="a text file to train on")
    parser.add_argument("--output", default="saved_models/tiny_lm")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt", default="The layer ")
    parser.add_argument("--num_new", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1. Received: {args.steps}")
    if not os.path.isfile(args.text):
        parser.error(f"--text must be a file. Received: {args.text}")
    if not args.prompt:
        parser.error("--prompt must hold at least one byte. Received: ''")
    if args.num_new < 1:
        parser.error(f"--num_new must be at least 1. Received: {args.num_new}")
    keras.utils.set_random_seed(args.seed)
    model = TinyLM()
    if len(args.prompt.encode()) + args.num_new > model.max_length:
        parser.error(
            f"--prompt's {len(args.prompt.encode())} bytes plus --num_new must be at most "
            f"{model.max_length}. Received: --num_new {args.num_new}"
        )
    inputs, targets = byte_windows(open(args.text, "rb").read(), 64, 32 * args.steps, args.seed)
    model.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(inputs, targets, batch_size=32, epochs=1, verbose=2)
    prompt = tf.constant([list(args.prompt.encode())], tf.int32)
    tokens = generate(model, prompt, tf.constant(args.num_new))
    print(repr(bytes(tokens[0].numpy().astype(np.uint8)).decode(errors="replace")))
    path = export_generate(model, args.output)
    print(f"SavedModel with a `generate` signature: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How many XLA compilations a compiled training step makes when every step brings new values.

Usage:
    KERAS_BACKEND=tensorflow python tests/compile_counts.py         # every scenario, as JSON
    KERAS_BACKEND=jax python tests/compile_counts.py fit_dense core  # some of them
    python tests/compile_counts.py --list                            # their names

Each scenario runs `STEPS` steps of one compiled program on the same shapes and new random
values, and records how many XLA compilations each step made. A program compiled once per
shape makes them on step 1 and none after. `tests/layer/test_compiled_once.py` runs this script in a
process of its own per backend (Keras reads its backend once, TensorFlow its log settings once).

The counters are the backends' own. TensorFlow logs every compilation of a cluster
(`device_compiler.h`: "Instantly compiling for signature ...", with `TF_CPP_VMODULE`, set here
before TensorFlow loads); the script sends its own stderr to a file and counts those lines.
JAX reports every backend compilation to `jax.monitoring` listeners.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
BACKEND = os.environ["KERAS_BACKEND"]
if BACKEND == "tensorflow":
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    os.environ["TF_CPP_VMODULE"] = "device_compiler=2"

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_sdpa  # noqa: E402
from keras_sdpa import ScaledDotProductAttention, mods  # noqa: E402

STEPS = 5
B, T, E, N, H = 4, 64, 32, 2, 16
COMPILED_LINE = "ompiling for signature"  # "Instantly compiling ...", not "Already Compiled ..."


class _TensorFlowCounter:
    """Compilations so far, from TensorFlow's log in this process's stderr (sent to a file)."""

    def __init__(self):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.stderr = os.dup(2)
        os.dup2(self.log.fileno(), 2)

    def __call__(self):
        sys.stderr.flush()
        with open(self.log.name, errors="replace") as log:
            return sum(COMPILED_LINE in line for line in log)

    def close(self):
        """Gives stderr back (a failing scenario's traceback must reach the caller)."""
        os.dup2(self.stderr, 2)


class _JaxCounter:
    """Compilations so far, as JAX reports them to `jax.monitoring`."""

    def __init__(self):
        import jax

        self.count = 0

        def listen(event, duration, **kwargs):
            if event == "/jax/core/compile/backend_compile_duration":
                self.count += 1

        jax.monitoring.register_event_duration_secs_listener(listen)

    def __call__(self):
        return self.count

    def close(self):
        pass


def _random(rng, shape, dtype="float32"):
    return rng.standard_normal(shape).astype(dtype)


class Probe(keras.Model):
    """The layer in a small regression model, called with a scenario's extra arguments."""

    def __init__(self, layer_options, call_options):
        super().__init__()
        self.attention = ScaledDotProductAttention(num_heads=N, key_dim=H, **layer_options)
        self.head = keras.layers.Dense(1)
        self.call_options = call_options

    def call(self, inputs, training=None):
        x, extra = inputs
        out = self.attention(x, x, training=training, **extra, **self.call_options)
        if self.call_options.get("return_attention_scores"):
            out, scores = out
            out = out + keras.ops.mean(scores, axis=(1, 3))[..., None]  # (B, T, E)
        return self.head(keras.ops.mean(out, axis=1))  # (B, 1)


def _extras(name, rng):
    """A scenario's extra call arguments, as new values each step."""
    if name == "mask":
        return {"attention_mask": rng.random((B, T, T)) > 0.3}  # (B, T, S)
    if name == "bias":
        return {"attention_bias": _random(rng, (B, N, T, T))}  # (B, N, T, S)
    if name == "mods":
        return {"segment_ids": np.sort(rng.integers(0, 3, (B, T)), axis=1).astype("int32")}
    return {}


def _fit_options(name):
    """The layer's and the call's options of a `fit_<name>` scenario."""
    tilt = keras.ops.convert_to_tensor(np.linspace(-1, 1, N).astype("float32"))
    captured = mods.with_tensors(lambda s, b, h, q, kv, t: s + keras.ops.take(t, h) * 0.1, tilt)
    layer = {
        "dense": {"flash_attention": False},
        "chunked": {"flash_attention": True, "chunk_size": 16},
        "causal": {},
        "mask": {},
        "bias": {},
        "dropout": {"dropout": 0.25, "seed": 3},
        "scores": {},
        "mods": {
            "score_mod": mods.relative_position_bias(N),  # a variable the step trains
            "mask_mod": mods.document(),  # reads the call's segment ids
        },
        "captured": {"score_mod": captured, "flash_attention": True, "chunk_size": 16},
    }[name]
    call = {"causal": {"use_causal_mask": True}, "scores": {"return_attention_scores": True}}
    return layer, call.get(name, {})


FITS = ("dense", "chunked", "causal", "mask", "bias", "dropout", "scores", "mods", "captured")


def fit(name, count, rng):
    """`model.compile(jit_compile=True)`, then `train_on_batch` on new values each step."""
    model = Probe(*_fit_options(name))
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    counts = []
    for _ in range(STEPS):
        x, y = _random(rng, (B, T, E)), _random(rng, (B, 1))
        before = count()
        model.train_on_batch((x, _extras(name, rng)), y)
        counts.append(count() - before)
    return counts


def keras_hub_block(count, rng):
    """A keras-hub `TransformerEncoder` swapped by `replace_attention`, trained compiled."""
    import keras_hub

    inputs = keras.Input((T, E))
    hidden = keras_hub.layers.TransformerEncoder(intermediate_dim=E, num_heads=N)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.ops.mean(hidden, axis=1)))
    report = keras_sdpa.replace_attention(model)
    if not report.swapped:
        raise RuntimeError(f"replace_attention swapped nothing:\n{report}")
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    counts = []
    for _ in range(STEPS):
        x, y = _random(rng, (B, T, E)), _random(rng, (B, 1))
        before = count()
        model.train_on_batch(x, y)
        counts.append(count() - before)
    return counts


def _compiled_gradient(loss):
    """`loss(*args)`'s value and gradients to its args, in the caller's compiled step
    (`tf.function(jit_compile=True)` with a tape, or `jax.jit` of `jax.value_and_grad`)."""
    if BACKEND == "jax":
        import jax

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    import tensorflow as tf

    @tf.function(jit_compile=True)
    def step(*args):
        with tf.GradientTape() as tape:
            tape.watch(args)
            value = loss(*args)
        return value, tape.gradient(value, args)

    return step


def core(implementation, count, rng):
    """The core's gradient inside a caller's compiled step, new `q`, `k`, `v` each step."""

    def loss(q, k, v):
        out = keras_sdpa.scaled_dot_product_attention(
            q, k, v, is_causal=True, implementation=implementation, chunk_size=16
        )
        return keras.ops.sum(out**2)

    step = _compiled_gradient(loss)
    counts = []
    for _ in range(STEPS):
        q, k, v = (_random(rng, (B, T, N, H)) for _ in range(3))
        before = count()
        keras.ops.convert_to_numpy(step(q, k, v)[0])
        counts.append(count() - before)
    return counts


def custom_step(count, rng):
    """The layer's model trained by the user's own compiled step (a tape or `jax.grad`)."""
    model = Probe({"dropout": 0.1}, {"use_causal_mask": True})
    model((np.zeros((B, T, E), "float32"), {}))
    weights = model.trainable_variables

    if BACKEND == "jax":
        import jax

        non_trainable = [v.value for v in model.non_trainable_variables]

        def loss(values, x, y):
            pred, _ = model.stateless_call(values, non_trainable, (x, {}), training=True)
            return keras.ops.mean((pred - y) ** 2)

        grad = jax.jit(jax.value_and_grad(loss))

        def step(x, y):
            value, grads = grad([v.value for v in weights], x, y)
            for variable, g in zip(weights, grads):
                variable.assign(variable.value - 0.01 * g)
            return value

    else:
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def step(x, y):
            with tf.GradientTape() as tape:
                value = keras.ops.mean((model((x, {}), training=True) - y) ** 2)
            for variable, g in zip(weights, tape.gradient(value, weights)):
                variable.assign_sub(0.01 * g)
            return value

    counts = []
    for _ in range(STEPS):
        x, y = _random(rng, (B, T, E)), _random(rng, (B, 1))
        before = count()
        keras.ops.convert_to_numpy(step(x, y))
        counts.append(count() - before)
    return counts


def cached(count, rng):
    """One decoding step against a key/value cache, compiled, new values and positions."""
    layer = ScaledDotProductAttention(num_heads=N, key_dim=H, num_key_value_heads=1)
    layer(np.zeros((B, 1, E), "float32"), np.zeros((B, 1, E), "float32"))

    def decode(x, cache, index):
        out, cache = layer(x, x, cache=cache, cache_update_index=index, use_causal_mask=True)
        return out, cache

    if BACKEND == "jax":
        import jax

        decode = jax.jit(decode)
    else:
        import tensorflow as tf

        decode = tf.function(decode, jit_compile=True)
    counts = []
    for step in range(STEPS):
        x, cache = _random(rng, (B, 1, E)), _random(rng, (B, 2, T, 1, H))
        index = np.full((B,), step + 3, "int32")
        before = count()
        keras.ops.convert_to_numpy(decode(x, cache, index)[0])
        counts.append(count() - before)
    return counts


def scenarios():
    """Every scenario by name: a function of `(count, rng)`."""
    table = {f"fit_{name}": (lambda n: lambda c, r: fit(n, c, r))(name) for name in FITS}
    table.update(
        core_dense=lambda c, r: core("dense", c, r),
        core_chunked=lambda c, r: core("chunked", c, r),
        custom_step=custom_step,
        cached=cached,
        keras_hub_block=keras_hub_block,
    )
    return table


def main(argv=None):
    names = (sys.argv[1:] if argv is None else argv) or list(scenarios())
    if names == ["--list"]:
        print(json.dumps(list(scenarios())))
        return
    count = _JaxCounter() if BACKEND == "jax" else _TensorFlowCounter()
    results = {}
    try:
        for name in names:
            keras.utils.set_random_seed(0)
            results[name] = scenarios()[name](count, np.random.default_rng(0))
    finally:
        count.close()
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""A kernel-swapped keras-hub decoder under `keras.distribution.ModelParallel`, against the
stock model on one device: run as a script, in a process of its own (JAX fixes its devices
when it starts), by tests/swap/test_model_parallel.py.

    KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python tests/model_parallel.py gemma

The stock causal LM is built tiny on one device (no distribution set): its greedy `generate`
tokens and two `fit` losses are the reference. Then, with `ModelParallel` over a 2 x 4
(`batch` x `model`) mesh of the 8 simulated CPU devices and the family's own
`get_layout_map`, the same model is built again with the same weights, swapped
(`keras_sdpa.replace_attention`), and generates and fits. Prints one JSON object: both runs'
tokens and losses, how many times the core ran, the kernels the report names, and for every
weight the layout map places, the partition spec it asked for and the one the variable has.
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_sdpa  # noqa: E402
from keras_sdpa import ops as core  # noqa: E402

VOCAB, B, T, PROMPT = 64, 2, 12, 4
# Every sharded size divisible by its mesh axis (JAX's sharding needs it): 8 query heads over
# 4 key/value heads, which the layout maps split over `model` (4) or `batch` (2).
SHAPE = dict(
    vocabulary_size=VOCAB,
    num_layers=2,
    hidden_dim=32,
    intermediate_dim=64,
    num_query_heads=8,
    num_key_value_heads=4,
)


def family(name):
    """(backbone class, its constructor's arguments, its causal LM class)."""
    if name == "gemma":
        from keras_hub.src.models.gemma.gemma_backbone import GemmaBackbone
        from keras_hub.src.models.gemma.gemma_causal_lm import GemmaCausalLM

        # Gemma 2's soft cap and window on, so that the kernel's options run sharded too.
        options = dict(
            SHAPE,
            head_dim=8,
            attention_logit_soft_cap=2.0,
            use_sliding_window_attention=True,
            sliding_window_size=3,
        )
        return GemmaBackbone, options, GemmaCausalLM
    from keras_hub.src.models.llama.llama_backbone import LlamaBackbone
    from keras_hub.src.models.llama.llama_causal_lm import LlamaCausalLM

    return LlamaBackbone, SHAPE, LlamaCausalLM


def build(name, seed):
    backbone_class, options, task_class = family(name)
    keras.utils.set_random_seed(seed)
    model = task_class(backbone=backbone_class(**options), preprocessor=None)
    model.compile(optimizer=keras.optimizers.SGD(0.1), sampler="greedy")
    return model


def data():
    """Prompts of 3 and 4 tokens padded to T, and a batch of token sequences to fit on."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (B, T)).astype("int32")
    prompt_mask = np.arange(T)[None, :] < np.array([[3], [PROMPT]])
    prompts = {"token_ids": np.where(prompt_mask, ids, 0), "padding_mask": prompt_mask}
    mask = np.ones((B, T), bool)
    mask[0, -3:] = False
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    return prompts, x, ids[:, 1:], mask[:, 1:]


def run(model):
    """Greedy tokens, then the losses of two `fit` steps on one batch."""
    prompts, x, y, weights = data()
    tokens = np.asarray(model.generate(prompts, stop_token_ids=None)["token_ids"])
    history = model.fit(
        x, y, sample_weight=weights, batch_size=B, epochs=2, shuffle=False, verbose=0
    )
    return tokens.tolist(), history.history["loss"]


def placements(model, layout_map):
    """`{path: (the spec the layout map asks for, the variable's spec)}` of the weights the
    map places."""
    result = {}
    for variable in model.backbone.weights:
        layout = layout_map[variable.path]
        if layout is None:
            continue
        spec = list(variable.value.sharding.spec)
        spec += [None] * (len(layout.axes) - len(spec))  # JAX drops trailing Nones
        result[variable.path] = (list(layout.axes), spec)
    return result


def main(name):
    calls = []
    real = core.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    core.scaled_dot_product_attention = counted
    stock = build(name, 0)
    weights = stock.get_weights()
    one_device = run(stock)
    assert not calls, "the stock model ran the core"

    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), jax.devices())
    backbone_class = family(name)[0]
    layout_map = backbone_class.get_layout_map(mesh, "model", "batch")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    ours = build(name, 1)
    ours.set_weights(weights)
    report = keras_sdpa.replace_attention(ours)
    sharded = run(ours)
    print(
        json.dumps(
            {
                "devices": len(jax.devices()),
                "one_device": one_device,
                "model_parallel": sharded,
                "core_calls": len(calls),
                "kernels": [kind for _, kind in report.kernels],
                "placements": placements(ours, layout_map),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])

"""What `keras_sdpa.replace_attention` buys keras-hub's models: stock against swapped.

Three models from keras-hub, built from small random configurations (nothing downloaded), each
timed as shipped and after `keras_sdpa.replace_attention(model, flash_attention=True)` with the
same weights:

- a BERT encoder (2 layers, 2 heads of 64, width 128), forward plus backward (the gradient of
  `sum(sequence_output * c)` with respect to every weight), at T=512 and T=8,192, with a
  padding mask;
- a ViT (the same sizes, 16-pixel patches), forward plus backward on one 1,024 x 1,024 image:
  4,097 tokens with the class token;
- GPT-2 (the same sizes), keras-hub's own `generate` (jit-compiled prefill and cache loop), per
  new token: 8 prompt tokens and `--new_tokens` new ones, greedy.

Every timed call gets new inputs, drawn before its clock starts (`common.Fed`): the models'
inputs and `c` are arguments of the compiled step, not tensors it captures. A batch of one
row gains nothing from `Fed`'s rotation over the batch, so the token ids (BERT's, GPT-2's
prompt) are new random ones each call; the image and `c` are drawn anew.

Times: alternating rounds in one process after one call that compiles; ratio = median of the
per-round ratios (swapped / stock; range in brackets). Peak MiB: resident memory during the first
call above the level after building the model, one child process per model, length and variant
(tracing and compilation included).

Usage:
    python benchmarks/swap.py
    python benchmarks/swap.py --rounds 3 --output BENCHMARKS.md
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    NEW_INPUTS,
    Fed,
    at_least_one,
    cpu_name,
    replace_section,
    time_alternating,
)

START, END = "<!-- swap:start -->", "<!-- swap:end -->"
WIDTH, HEADS, LAYERS = 128, 2, 2
PROMPT, VOCABULARY = 8, 1000


class NewIds(Fed):
    """A `Fed` step whose first input holds token ids of a batch of one row, where rotating
    over the batch would change nothing: each draw gives every nonzero id a new random one
    (1 to `VOCABULARY - 1`), zeros (padding) kept; the other inputs as `Fed` draws them."""

    def draw(self):
        import keras
        import numpy as np

        inputs = super().draw()
        ids = self.arrays[0]
        fresh = self.rng.integers(1, VOCABULARY, ids.shape)
        self.arrays[0] = np.where(ids != 0, fresh, 0).astype(ids.dtype)
        inputs[0] = keras.ops.convert_to_tensor(self.arrays[0], str(ids.dtype))
        return inputs


def build(family, length, swapped):
    """A keras-hub model's step, stock or swapped: a `Fed` step (`NewIds` where it takes token
    ids), whose ids, image and cotangent are new on every call."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    keras.utils.set_random_seed(0)
    if family == "gpt2":
        return gpt2_step(length, swapped)
    return gradient_step(family, length, swapped)


def gpt2_step(length, swapped):
    """keras-hub's own `generate` of GPT-2, a new random prompt of `PROMPT` ids each call."""
    import numpy as np
    from keras_hub.src.models.gpt2.gpt2_backbone import GPT2Backbone
    from keras_hub.src.models.gpt2.gpt2_causal_lm import GPT2CausalLM

    import keras_sdpa

    backbone = GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=LAYERS,
        num_heads=HEADS,
        hidden_dim=WIDTH,
        intermediate_dim=4 * WIDTH,
        max_sequence_length=length,
        dropout=0.0,
    )
    model = GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(sampler="greedy")
    if swapped:
        keras_sdpa.replace_attention(model)
    ids = np.zeros((1, length), "int32")
    ids[0, :PROMPT] = np.arange(1, PROMPT + 1)

    def generate(ids, padding_mask):
        prompt = {"token_ids": ids, "padding_mask": padding_mask}
        return np.asarray(model.generate(prompt, stop_token_ids=None)["token_ids"])

    return NewIds(generate, [ids, ids != 0])


def gradient_step(family, length, swapped):
    """BERT's or ViT's forward plus backward: the gradient of `sum(output * c)` with respect
    to every weight, the inputs and `c` arguments of the `tf.function`."""
    import numpy as np
    import tensorflow as tf

    import keras_sdpa

    if family == "bert":
        from keras_hub.src.models.bert.bert_backbone import BertBackbone

        model = BertBackbone(
            vocabulary_size=VOCABULARY,
            num_layers=LAYERS,
            num_heads=HEADS,
            hidden_dim=WIDTH,
            intermediate_dim=4 * WIDTH,
            max_sequence_length=length,
            dropout=0.0,
        )
        ids = np.random.default_rng(0).integers(1, VOCABULARY, (1, length)).astype("int32")
        mask = np.arange(length)[None] < length - length // 8  # the last eighth is padding
        names, inputs = ("token_ids", "segment_ids", "padding_mask"), [ids, 0 * ids, mask]
        tokens, output = length, "sequence_output"
    else:
        from keras_hub.src.models.vit.vit_backbone import ViTBackbone

        model = ViTBackbone(
            image_shape=(length, length, 3),
            patch_size=16,
            num_layers=LAYERS,
            num_heads=HEADS,
            hidden_dim=WIDTH,
            mlp_dim=4 * WIDTH,
        )
        names, inputs = None, [np.random.default_rng(1).uniform(size=(1, length, length, 3))]
        inputs[0] = inputs[0].astype("float32")
        tokens, output = (length // 16) ** 2 + 1, None  # the patches and the class token
    if swapped:
        keras_sdpa.replace_attention(model, flash_attention=True)
    c = np.random.default_rng(2).standard_normal((1, tokens, WIDTH)).astype("float32")

    @tf.function
    def step(*args):  # the model's inputs, then c
        args, c = args[:-1], args[-1]
        with tf.GradientTape() as tape:
            out = model(dict(zip(names, args)) if names else args[0])
            loss = tf.reduce_sum((out[output] if output else out) * c)
        grads = tape.gradient(loss, model.trainable_weights)
        # One scalar that needs every gradient, so that a call waits for all of them.
        return tf.add_n([tf.reduce_sum(tf.convert_to_tensor(g)) for g in grads if g is not None])

    def run(*args):
        return step(*args).numpy()

    return (NewIds if names else Fed)(run, [*inputs, c])


def peak_mib(family, length, swapped, timeout=1800):
    """In a child process: the peak resident MiB of the first step (tracing and compilation
    included) above the level after the model is built."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = (
        f"import sys, json; sys.path.insert(0, {here!r}); import swap as m; "
        f"from common import PeakSampler, rss_mib; step = m.build({family!r}, {length}, "
        f"{swapped}); base = rss_mib(); s = PeakSampler(); step(); "
        "print(json.dumps(s.stop() - base))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout
    )
    if result.returncode:
        return f"exit {result.returncode}"
    return round(json.loads(result.stdout.strip().splitlines()[-1]))


def measure(family, length, rounds, per):
    print(f"{family} at {length}", file=sys.stderr)
    seconds = time_alternating(
        {"stock": build(family, length, False), "swapped": build(family, length, True)}, rounds
    )
    ratios = sorted(a / b for a, b in zip(seconds["swapped"], seconds["stock"]))
    memory = {name: peak_mib(family, length, name == "swapped") for name in ("stock", "swapped")}
    print(f"  {seconds} {memory}", file=sys.stderr)
    return {
        "stock": statistics.median(seconds["stock"]) / per,
        "swapped": statistics.median(seconds["swapped"]) / per,
        "ratio": (statistics.median(ratios), ratios[0], ratios[-1]),
        "memory": memory,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bert_lengths", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--image_size", type=int, default=1024)
    parser.add_argument("--new_tokens", type=int, default=248)
    parser.add_argument("--output", help="a Markdown file whose swap section is replaced")
    args = parser.parse_args(argv)
    at_least_one(parser, args, "rounds", "image_size", "new_tokens")
    rows = []
    for length in args.bert_lengths:
        rows.append(
            (
                "BERT encoder, forward + backward",
                f"T={length:,}",
                "s",
                measure("bert", length, args.rounds, 1),
            )
        )
    tokens = (args.image_size // 16) ** 2 + 1
    rows.append(
        (
            "ViT, forward + backward",
            f"{args.image_size}x{args.image_size} ({tokens:,} tokens)",
            "s",
            measure("vit", args.image_size, args.rounds, 1),
        )
    )
    total = PROMPT + args.new_tokens
    rows.append(
        (
            "GPT-2 `generate`, per new token",
            f"S={total}",
            "ms",
            measure("gpt2", total, args.rounds, args.new_tokens / 1e3),
        )
    )
    lines = [
        "## keras-hub models with their attention swapped",
        "",
        "Produced by:",
        "",
        f"    python benchmarks/swap.py --rounds {args.rounds} --output BENCHMARKS.md",
        "",
        f"On {cpu_name()}. keras-hub's BERT, ViT and GPT-2 ({LAYERS} layers, {HEADS} heads of "
        f"{WIDTH // HEADS}, width {WIDTH}, random weights), as shipped and after "
        "`keras_sdpa.replace_attention(model, flash_attention=True)` (GPT-2: "
        "`replace_attention(model)`, whose cached calls take the decode path) with the same "
        f"weights; `tf.function` steps in graph mode, GPT-2 through its own `generate`. "
        f"{NEW_INPUTS} Here, with batches of one, the token ids (BERT's, GPT-2's prompt) are "
        "new random ids each call, the image and the cotangent `c` new normal values. "
        f"{args.rounds} alternating rounds in one process after a call that compiles; ratio = "
        "median of the per-round ratios (swapped / stock; range in brackets). Peak MiB: "
        "resident memory during the first call above the level after building the model, one "
        "child process each (tracing and compilation included).",
        "",
        "| model | size | stock | swapped | time ratio | stock peak MiB | swapped peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, size, unit, r in rows:
        ratio, low, high = r["ratio"]
        lines.append(
            f"| {label} | {size} | {r['stock']:.3g} {unit} | {r['swapped']:.3g} {unit} | "
            f"**{ratio:.3f}** ({low:.3f}-{high:.3f}) | {r['memory']['stock']} | "
            f"{r['memory']['swapped']} |"
        )
    section = "\n".join(lines) + "\n"
    print(section)
    if args.output:
        replace_section(args.output, START, END, section)


if __name__ == "__main__":
    main()

"""Long prompts on keras-hub's decoder LLMs: stock against the kernel swap.

`keras_sdpa.replace_attention` keeps a decoder family's own attention class and runs its kernel on
the core (`keras_sdpa._swap.families`). The family hands its kernel a `(B, T, S)` causal-and-padding
mask (banded for a window); the chunked path reads that mask in blocks and skips the blocks it
empties, so the `T x S` scores are never formed. Models built tiny from their constructors (2
layers, 4 query heads of 32 over 2 key/value heads, width 128, random weights):

- Llama, forward plus backward (the gradient of `sum(sequence_output * c)` with respect to every
  weight) at `--length` tokens, the last eighth padding;
- Gemma with Gemma 2's options: a logit soft cap of 50 and a sliding window of `--window` on
  every other layer;
- Mistral with its sliding window of `--window` against the same model with the full causal
  mask, both swapped: what skipping the blocks outside the band buys;
- Llama's `generate` per new token: a prompt of `--prompt` tokens and `--new_tokens` greedy ones;
- Llama's decoding loop alone, per token: `--decode_tokens` greedy steps of its `call_with_cache`
  at the end of a cache of `--length` (decode reads the whole cache once per token: there
  Llama's repeated keys cost `groups` copies, the swap reads each key/value head once).

Every timed call gets new token ids and a new `c`, drawn before its clock starts (batches of one
row: new random ids rather than a rotation). Times: alternating rounds in one process after one
call that traces; `tf.function` steps in graph mode (TensorFlow). Peak MiB: one child process
per model and variant, resident memory during the first call above the level once the model
is built and its inputs drawn.

Usage:
    python benchmarks/decoders.py
    python benchmarks/decoders.py --rounds 3 --output BENCHMARKS.md
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    NEW_INPUTS,
    at_least_one,
    child_peak_mib,
    command_line,
    cpu_name,
    replace_section,
    time_alternating,
)
from swap import VOCABULARY, NewIds  # noqa: E402

START, END = "<!-- decoders:start -->", "<!-- decoders:end -->"
WIDTH, LAYERS = 128, 2
SHAPE = dict(
    vocabulary_size=VOCABULARY,
    num_layers=LAYERS,
    hidden_dim=WIDTH,
    intermediate_dim=2 * WIDTH,
    num_query_heads=4,
    num_key_value_heads=2,
)


def backbone(family, window):
    """A tiny keras-hub backbone: `llama`, `gemma2` (soft cap, window), `mistral` (window),
    `mistral_full` (no window)."""
    if family == "llama":
        from keras_hub.src.models.llama.llama_backbone import LlamaBackbone

        return LlamaBackbone(**SHAPE)
    if family == "gemma2":
        from keras_hub.src.models.gemma.gemma_backbone import GemmaBackbone

        return GemmaBackbone(
            **SHAPE,
            head_dim=WIDTH // 4,
            attention_logit_soft_cap=50.0,
            use_sliding_window_attention=True,
            sliding_window_size=window,
        )
    from keras_hub.src.models.mistral.mistral_backbone import MistralBackbone

    return MistralBackbone(**SHAPE, sliding_window=window if family == "mistral" else None)


def make_step(family, swapped, length, window=1024, new_tokens=0, decode=False):
    """A `NewIds` step: forward plus backward; with `new_tokens`, Llama's `generate`, or with
    `decode` too, Llama's decoding loop alone."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import keras_sdpa

    keras.utils.set_random_seed(0)
    model = backbone(family, window)
    if decode:
        return decode_step(model, swapped, length, new_tokens)
    if new_tokens:
        return generate_step(model, swapped, length, new_tokens)
    if swapped:
        keras_sdpa.replace_attention(model)
    ids = np.random.default_rng(0).integers(1, VOCABULARY, (1, length)).astype("int32")
    padding = np.arange(length)[None] < length - length // 8
    c = np.random.default_rng(2).standard_normal((1, length, WIDTH)).astype("float32")
    return NewIds(gradient_step(model), [ids * padding, padding, c])


def gradient_step(model):
    import tensorflow as tf

    @tf.function
    def step(ids, padding, c):
        with tf.GradientTape() as tape:
            out = model({"token_ids": ids, "padding_mask": padding})
            loss = tf.reduce_sum(out * c)
        grads = tape.gradient(loss, model.trainable_weights)
        # One scalar that needs every gradient, so that a call waits for all of them.
        return tf.add_n([tf.reduce_sum(tf.convert_to_tensor(g)) for g in grads if g is not None])

    return lambda *args: step(*args).numpy()


def generate_step(backbone, swapped, prompt, new_tokens):
    """Llama's own `generate` (its compiled prefill and cache loop), greedy, no stop token."""
    import numpy as np
    from keras_hub.src.models.llama.llama_causal_lm import LlamaCausalLM

    import keras_sdpa

    model = LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(sampler="greedy")
    if swapped:
        keras_sdpa.replace_attention(model)
    ids = np.zeros((1, prompt + new_tokens), "int32")
    ids[0, :prompt] = np.random.default_rng(0).integers(1, VOCABULARY, prompt)

    def generate(ids, padding_mask):
        inputs = {"token_ids": ids, "padding_mask": padding_mask}
        return np.asarray(model.generate(inputs, stop_token_ids=None)["token_ids"])

    return NewIds(generate, [ids, ids != 0])


def decode_step(backbone, swapped, length, new_tokens):
    """Llama's decoding loop without its prefill: `new_tokens` greedy steps of its own
    `call_with_cache` in one XLA-compiled `tf.while_loop` (as its `generate` runs them), the
    last `new_tokens` positions of a cache of `length` that its own prefill (`_build_cache`)
    filled. Each call gets a new first token and new cache values."""
    import numpy as np
    from keras_hub.src.models.llama.llama_causal_lm import LlamaCausalLM

    import keras_sdpa

    model = LlamaCausalLM(backbone=backbone, preprocessor=None)
    if swapped:
        keras_sdpa.replace_attention(model)
    start = length - new_tokens
    ids = np.random.default_rng(0).integers(1, VOCABULARY, (1, length)).astype("int32")
    _, cache = model._build_cache(ids)
    return NewIds(decoding_loop(model, start, new_tokens), [ids[:, :1], cache])


def decoding_loop(model, start, new_tokens):
    import tensorflow as tf

    @tf.function(jit_compile=True)
    def loop(token, cache):
        def body(index, token, cache):
            logits, _, cache = model.call_with_cache(token, cache, index)
            return index + 1, tf.argmax(logits[:, -1:], axis=-1, output_type="int32"), cache

        def more(index, token, cache):
            return index < start + new_tokens

        _, token, _ = tf.while_loop(more, body, (tf.constant(start), token, cache))
        return token

    return lambda *args: loop(*args).numpy()


def measure(variants, rounds, per=1.0):
    """Seconds per call (over `per`) of each variant (name -> `make_step` arguments), their
    ratios to the first, and each one's peak MiB in a child process."""
    print(f"{variants}", file=sys.stderr)
    seconds = time_alternating({name: make_step(*a) for name, a in variants.items()}, rounds)
    first = next(iter(variants))
    result = {"seconds": {n: statistics.median(s) / per for n, s in seconds.items()}}
    result["ratio"] = {}
    for name in variants:
        ratios = sorted(a / b for a, b in zip(seconds[name], seconds[first]))
        result["ratio"][name] = (statistics.median(ratios), ratios[0], ratios[-1])
    result["memory"] = {n: child_peak_mib("decoders", a) for n, a in variants.items()}
    print(f"  {result}", file=sys.stderr)
    return result


def rows(args):
    t, w = args.length, args.window
    pairs = [
        ("Llama, forward + backward", "llama", ()),
        (f"Gemma (soft cap 50, window {w:,}), forward + backward", "gemma2", (w,)),
    ]
    for label, family, extra in pairs:
        r = measure(
            {"stock": (family, False, t, *extra), "swapped": (family, True, t, *extra)},
            args.rounds,
        )
        yield label, f"T={t:,}", "s", r, ("stock", "swapped")
    r = measure(
        {
            "swapped, full causal": ("mistral_full", True, t, w),
            f"swapped, window {w:,}": ("mistral", True, t, w),
            f"stock, window {w:,}": ("mistral", False, t, w),
        },
        args.rounds,
    )
    yield f"Mistral, window {w:,} against full causal", f"T={t:,}", "s", r, tuple(r["seconds"])
    r = measure(
        {
            "stock": ("llama", False, args.prompt, 0, args.new_tokens),
            "swapped": ("llama", True, args.prompt, 0, args.new_tokens),
        },
        args.generate_rounds,
        per=args.new_tokens / 1e3,
    )
    total = f"{args.prompt:,} + {args.new_tokens}"
    yield "Llama `generate`, per new token", total, "ms", r, ("stock", "swapped")
    r = measure(
        {
            "stock": ("llama", False, t, 0, args.decode_tokens, True),
            "swapped": ("llama", True, t, 0, args.decode_tokens, True),
        },
        args.generate_rounds,
        per=args.decode_tokens / 1e3,
    )
    label = f"Llama decoding loop, per token ({args.decode_tokens} tokens)"
    yield label, f"cache {t:,}", "ms", r, ("stock", "swapped")


def table(args, measured):
    lines = [
        "## Long prompts on keras-hub's decoder LLMs",
        "",
        "Produced by:",
        "",
        f"    {command_line(__file__, args.argv)}",
        "",
        f"On {cpu_name()}. keras-hub's Llama, Gemma (Gemma 2's soft cap and window) and "
        f"Mistral, {LAYERS} layers, 4 query heads of 32 over 2 key/value heads, width {WIDTH}, "
        "random weights, as shipped and after `keras_sdpa.replace_attention(model)` (the "
        "family's attention class kept, its kernel on the core) with the same weights; "
        "`tf.function` steps in graph mode, the last eighth of each sequence padding; "
        f"`generate` is Llama's own. {NEW_INPUTS} Here, with batches of one, the token ids "
        f"are new random ids each call and `c` new normal values. {args.rounds} alternating "
        f"rounds ({args.generate_rounds} for `generate` and the decoding loop, whose calls are "
        "short) in one process "
        "after a call that traces; ratio = median of the per-round "
        "ratios to the row's first variant (range in brackets). Peak MiB: resident memory "
        "during the first call above the level once the model is built and its inputs drawn, "
        "one child process each (tracing included).",
        "",
        "| model | size | variant | time | ratio | peak MiB |",
        "|---|---|---|---|---|---|",
    ]
    for label, size, unit, r, names in measured:
        for name in names:
            ratio, low, high = r["ratio"][name]
            lines.append(
                f"| {label} | {size} | {name} | {r['seconds'][name]:.3g} {unit} | "
                f"**{ratio:.3f}** ({low:.3f}-{high:.3f}) | {r['memory'][name]} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--decode_tokens", type=int, default=32)
    # A `generate` call is short (a fifth of a second) and its ratio noisy: 3 rounds of it
    # gave 0.877x and 1.222x on the same code, 15 rounds 0.818x (0.61-0.95).
    parser.add_argument("--generate_rounds", type=int, default=15)
    parser.add_argument("--output", help="a Markdown file whose decoders section is replaced")
    args = parser.parse_args(argv)
    at_least_one(
        parser,
        args,
        "rounds",
        "length",
        "window",
        "prompt",
        "new_tokens",
        "decode_tokens",
        "generate_rounds",
    )
    if args.decode_tokens > args.length:
        parser.error(
            f"--decode_tokens must be at most --length ({args.length:,}); "
            f"received {args.decode_tokens:,}"
        )
    args.argv = sys.argv[1:] if argv is None else argv
    section = table(args, list(rows(args)))
    print(section)
    if args.output:
        replace_section(args.output, START, END, section, before="\n<!-- against-commit:start -->")
        print(f"Wrote the decoders table to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()

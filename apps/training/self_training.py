"""Self-training: a finished run (the teacher) labels the unlabelled reviews, and this run
trains on the ones it is surest of, beside the labelled ones (`--self_training_from`).

The teacher must have carved the same validation set out of train (same dataset, seed and
`--validation_fraction`): it never trained on this run's validation reviews, which pick the kept
epoch and fit the temperature (its own kept epoch and temperature were chosen on them, so the
student's validation figures lean slightly optimistic; the test split is the one to compare).
It labels only the unlabelled split, less any review whose text or token ids are a validation
or test review's; the test split is never read here. It computes in its own precision.
"""

import json
import os
import time

import numpy as np

from ..classifier import data
from ..classifier.run_folder import load_run
from ..serving.compiled import compiled_classifier
from .batches import eval_dataset
from .build import dtype_policy
from .config import differing_flags
from .pretrain import held_out_rows

# The teacher's flags that decide which reviews are its validation set.
_SAME_VALIDATION = ("dataset", "seed", "validation_fraction")


def pseudo_labelled(config, splits, vectorizer, unlabeled_ids, held_out_ids, batch_size):
    """The teacher's surest unlabelled reviews: their token ids `(k, L)` (this run's
    vectorizer), the teacher's labels `(k,)` and the stage's record for `metrics.json`.

    `unlabeled_ids` `(n, L)` are `splits.unlabeled_text` as this run reads them;
    `held_out_ids`, the validation and test reviews'. Half of the `--self_training_reviews`
    come from each predicted class, the largest teacher log-odds first; fewer if the teacher
    predicts fewer of a class. Smoke runs (`--max_steps`) label the first `max_steps`
    batches' worth of reviews only."""
    started = time.time()
    with open(os.path.join(config.self_training_from, "metrics.json")) as f:
        teacher_config = json.load(f)["config"]
    _check_teacher(config, teacher_config)
    limit = None if config.max_steps is None else config.max_steps * batch_size
    candidates = np.flatnonzero(~held_out_rows(unlabeled_ids[:limit], held_out_ids))
    if not len(candidates):
        raise ValueError(
            f"no unlabelled review is left to label (of {len(unlabeled_ids[:limit])} read, every "
            f"one is a held-out review). Received: self_training_from={config.self_training_from!r}"
        )
    print(f"The teacher ({config.self_training_from}) labels {len(candidates)} unlabelled reviews")
    with dtype_policy(teacher_config.get("mixed_precision") or "float32"):
        teacher = load_run(config.self_training_from)
        # This run's token ids where the teacher reads the same words at the same length.
        same_words = teacher.vectorizer.get_vocabulary() == vectorizer.get_vocabulary() and (
            teacher_config["sequence_length"] == config.sequence_length
        )
        if same_words:
            teacher_ids = unlabeled_ids[candidates]
        else:
            teacher_ids = data.vectorize(teacher.vectorizer, splits.unlabeled_text[candidates])
        log_odds = teacher_log_odds(teacher.model, teacher_ids, batch_size)
    chosen, labels = surest(log_odds, config.self_training_reviews // 2)
    if not len(chosen):
        raise ValueError(
            f"the teacher predicts one class for all {len(candidates)} unlabelled reviews, so no "
            f"balanced set can be kept. Received: self_training_from={config.self_training_from!r}"
        )
    confidence = 1 / (1 + np.exp(-np.abs(log_odds[chosen])))
    print(
        f"{len(chosen)} of them train beside the labelled reviews ({len(chosen) // 2} per "
        f"class; the teacher's probability of its label is at least {confidence.min():.4f})"
    )
    record = {
        "teacher": config.self_training_from,
        "teacher_test_accuracy": teacher.metrics.get("test_accuracy"),
        "teacher_commit": teacher.metrics.get("git_commit"),
        "labelled_by_teacher": int(len(candidates)),
        "reviews": int(len(chosen)),
        "positive": int(np.sum(labels)),
        "lowest_confidence": round(float(confidence.min()), 6),
        "same_vocabulary": bool(same_words),
        "seconds": round(time.time() - started, 1),
    }
    return unlabeled_ids[candidates[chosen]], labels, record


def surest(log_odds, per_class):
    """Indices (ascending) of the `per_class` largest and the `per_class` smallest of
    `log_odds` `(n,)`, each among its own sign, and their labels (1 where positive). Both
    classes get as many: `min(per_class, positives, negatives)`."""
    positive = np.flatnonzero(log_odds > 0)
    negative = np.flatnonzero(log_odds < 0)
    count = min(per_class, len(positive), len(negative))
    top = positive[np.argsort(-log_odds[positive], kind="stable")[:count]]
    bottom = negative[np.argsort(log_odds[negative], kind="stable")[:count]]
    chosen = np.sort(np.concatenate([top, bottom]))
    return chosen, (log_odds[chosen] > 0).astype("int64")


def teacher_log_odds(model, ids, batch_size):
    """`model`'s log-odds `(n,)` for token ids `ids` `(n, L)`, in their order."""
    classify = compiled_classifier(model, log_odds=True)
    # eval_dataset batches in order of length: each row carries its own index as its label
    # (a float32 label: exact below 2**24 rows).
    rows = eval_dataset(ids, np.arange(len(ids)), batch_size)
    log_odds = np.empty(len(ids), "float64")
    for batch, index in rows:
        log_odds[index.numpy().astype("int64")] = classify(batch).numpy()
    return log_odds


def _check_teacher(config, teacher):
    differ = differing_flags(config, teacher, _SAME_VALIDATION, "teacher", "this run")
    if differ:
        raise ValueError(
            "`--self_training_from` must be a run with this run's validation set (it may not "
            "have trained on this run's validation reviews), but these flags differ: "
            + ", ".join(differ)
            + f". Received: self_training_from={config.self_training_from!r}"
        )

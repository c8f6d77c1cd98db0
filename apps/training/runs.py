"""Re-exporting a finished training run's SavedModel with this version's signatures.

Usage:
    python -m apps.runs --run saved_models/imdb_sdpa --data_dir ../shared/data/tensorflow_datasets

The folder's classifier is loaded back as Keras models (`apps.classifier.run_folder.load_run`:
from its `model.keras`, or, where only the SavedModel was kept (the shipped run), from the
SavedModel's variables, matched by name). The CLI re-exports the folder's SavedModel with
this version's signatures (`apps.serving.export.export_saved_model`) and checks, on the whole test
split, that the new SavedModel's accuracy is the one in `metrics.json`; it replaces the old
one only then.
"""

import dataclasses
import os
import shutil
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from .. import cli, files  # noqa: E402
from ..classifier import data  # noqa: E402
from ..classifier.run_folder import load_run  # noqa: E402
from ..inspection import model_card  # noqa: E402
from ..serving import export  # noqa: E402


@dataclasses.dataclass
class Config:
    run: str = "saved_models/imdb_sdpa"  # a training run's folder
    data_dir: str | None = None  # TFDS folder; else $TFDS_DATA_DIR; else TFDS's default
    batch_size: int = 256  # reviews per call when checking the accuracy


def reexport(config):
    """Re-exports `config.run`'s SavedModel; returns the accuracy the new one measured."""
    run = load_run(config.run)
    metrics = run.metrics
    target = os.path.join(config.run, "saved_model")
    staging = os.path.join(config.run, "saved_model.reexport")
    print(f"Weights from {run.weights_from}; exporting to {staging}")
    export.export_saved_model(run.model, run.inspector, run.vectorizer, staging)
    texts, labels, split = data.load_test_split(
        metrics["config"]["dataset"], data.resolve_data_dir(config.data_dir)
    )
    if split != metrics["test_split"] or len(texts) != metrics["test_examples"]:
        raise ValueError(
            f"the run reported on {metrics['test_examples']} reviews of `{metrics['test_split']}`,"
            f" but TFDS gives {len(texts)} of `{split}`; not replacing its SavedModel"
        )
    loaded = tf.saved_model.load(staging)
    serve = loaded.signatures["serving_default"]
    progress = keras.utils.Progbar(len(texts), unit_name="review")
    correct = 0
    for start in range(0, len(texts), config.batch_size):
        batch = texts[start : start + config.batch_size]
        label = serve(text=tf.constant(batch))["label"].numpy()
        correct += int(np.sum(label == labels[start : start + config.batch_size]))
        progress.add(len(batch))
    accuracy = correct / len(texts)
    # metrics.json holds Keras's float32 running mean: equal to within a count of one review.
    if abs(accuracy - metrics["test_accuracy"]) > 1.5 / len(texts):
        raise ValueError(
            f"the re-exported SavedModel reads {accuracy:.5f} on {split}, not the recorded "
            f"{metrics['test_accuracy']:.5f}; {target} is left as it was (new one: {staging})"
        )
    shutil.rmtree(target)
    os.replace(staging, target)
    serving = export.measure_serving(target, texts[:2048])
    serving_path = files.write_json_atomic(os.path.join(config.run, "serving.json"), serving)
    model_card.write_model_card(metrics, os.path.join(config.run, "README.md"))
    return accuracy, split, len(texts), target, serving_path


def main(argv=None):
    config = cli.parse_config(
        Config,
        argv,
        prog="python -m apps.runs",
        description="Re-export a training run's SavedModel with this version's signatures.",
    )
    try:
        accuracy, split, count, target, serving = reexport(config)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{split} accuracy {accuracy:.5f} on {count} reviews, as recorded. Wrote:")
    print(f"  saved_model          {target}")
    print(f"  serving              {serving}")
    print(f"  model_card           {os.path.join(config.run, 'README.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""TFDS loading, the train/validation split, and text vectorization.

The data comes from tensorflow-datasets' own builders (`tfds.builder(...)`), so
a user anywhere gets it through TFDS's normal download, and a machine without
network reads an existing TFDS folder through `data_dir` (or `TFDS_DATA_DIR`).
"""

import dataclasses
import os

import keras
import numpy as np
import tensorflow as tf

# TFDS text datasets with labelled (text, label) examples that the app knows. Others work
# too if they have a text feature and an integer `label`.
KNOWN_DATASETS = ("imdb_reviews", "glue/sst2", "yelp_polarity_reviews")


@dataclasses.dataclass
class Splits:
    """Raw texts (bytes) and integer labels, as NumPy arrays."""

    train_text: np.ndarray
    train_label: np.ndarray
    validation_text: np.ndarray
    validation_label: np.ndarray
    test_text: np.ndarray
    test_label: np.ndarray
    test_split: str  # the TFDS split the test set came from
    num_classes: int
    # the unlabelled reviews read for the vocabularies (`--vocabulary_source
    # train+unsupervised`), less any held-out review's text; None where none were read
    unlabeled_text: np.ndarray | None = None


def resolve_data_dir(data_dir):
    """`data_dir`, else `TFDS_DATA_DIR`, else None (TFDS's default, `~/tensorflow_datasets`)."""
    data_dir = data_dir or os.environ.get("TFDS_DATA_DIR") or None
    if data_dir is not None:
        data_dir = os.path.abspath(os.path.expanduser(data_dir))
    return data_dir


def load_splits(dataset="imdb_reviews", data_dir=None, validation_fraction=0.1, seed=0):
    """Loads a TFDS text dataset and carves a validation set out of train.

    The validation set is a fixed-seed random `validation_fraction` of the train split.
    The test split is returned untouched for the final report only. Datasets whose
    `test` split is unlabelled (GLUE) report on their `validation` split instead, and
    then the app's own validation set still comes from train.
    """
    import tensorflow_datasets as tfds  # slow import; only the app needs it

    if not 0 < validation_fraction < 1:
        raise ValueError(
            f"`validation_fraction` must be in (0, 1). Received: {validation_fraction}"
        )
    builder, text_key, label_key = _prepared_builder(dataset, data_dir)

    def as_numpy(split):
        ds = builder.as_dataset(split=split, batch_size=-1)
        batch = tfds.as_numpy(ds)
        return batch[text_key], batch[label_key].astype("int64")

    train_text, train_label = as_numpy("train")
    test_split = "test" if "test" in builder.info.splits else "validation"
    test_text, test_label = as_numpy(test_split)
    if np.all(test_label < 0) and "validation" in builder.info.splits:
        test_split = "validation"  # GLUE's test labels are hidden (-1)
        test_text, test_label = as_numpy(test_split)
    labelled = train_label >= 0
    train_text, train_label = train_text[labelled], train_label[labelled]

    order = np.random.default_rng(seed).permutation(len(train_text))
    num_validation = max(1, int(round(validation_fraction * len(train_text))))
    validation, train = order[:num_validation], order[num_validation:]
    num_classes = builder.info.features[label_key].num_classes
    return Splits(
        train_text=train_text[train],
        train_label=train_label[train],
        validation_text=train_text[validation],
        validation_label=train_label[validation],
        test_text=test_text,
        test_label=test_label,
        test_split=test_split,
        num_classes=num_classes,
    )


def load_test_split(dataset="imdb_reviews", data_dir=None):
    """The labelled split a run reports on (`test`, else `validation`), as `load_splits` picks
    it: `(texts, labels, split name)`, without reading train."""
    import tensorflow_datasets as tfds

    builder, text_key, label_key = _prepared_builder(dataset, data_dir)
    split = "test" if "test" in builder.info.splits else "validation"
    batch = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1))
    if np.all(batch[label_key] < 0) and "validation" in builder.info.splits:
        split = "validation"  # GLUE's test labels are hidden (-1)
        batch = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1))
    return batch[text_key], batch[label_key].astype("int64"), split


def load_unlabeled(dataset="imdb_reviews", data_dir=None):
    """The raw texts of the dataset's `unsupervised` split (IMDB's 50,000 unlabelled reviews),
    for counts that need no label; a `ValueError` if the dataset has no such split."""
    import tensorflow_datasets as tfds

    builder, text_key, _ = _prepared_builder(dataset, data_dir)
    if "unsupervised" not in builder.info.splits:
        raise ValueError(
            f"`--vocabulary_source train+unsupervised` needs a dataset with an `unsupervised` "
            f"split. Received: dataset={dataset!r} with splits {sorted(builder.info.splits)}"
        )
    batch = tfds.as_numpy(builder.as_dataset(split="unsupervised", batch_size=-1))
    return batch[text_key]


def _prepared_builder(dataset, data_dir):
    """The TFDS builder of `dataset`, prepared in `data_dir` (or downloaded), and its
    (text, label) feature names; a `ValueError` a user can act on when that fails."""
    import tensorflow_datasets as tfds

    data_dir = resolve_data_dir(data_dir)
    try:
        builder = tfds.builder(dataset, data_dir=data_dir)
    except Exception as error:  # tfds raises DatasetNotFoundError and friends
        raise ValueError(
            f"`dataset` is not a TFDS dataset this TFDS knows. Received: dataset={dataset!r} "
            f"({type(error).__name__}: {error})"
        ) from None
    text_key, label_key = _text_and_label_keys(builder.info)
    try:
        builder.download_and_prepare()  # a no-op when the data is already in data_dir
    except Exception as error:  # no network, a half-written folder, a failed manual step
        raise ValueError(
            f"could not load `dataset={dataset!r}`: tensorflow-datasets looked for it in "
            f"{builder.data_dir} and then failed to download it ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). Point --data_dir (or "
            "TFDS_DATA_DIR) at a folder that holds it as TFDS prepares it (on the project's "
            "machines: --data_dir ../shared/data/tensorflow_datasets), or prepare it on a "
            f"machine with network (`tfds build {dataset}`) and copy that folder here."
        ) from None
    return builder, text_key, label_key


def _text_and_label_keys(info):
    """The (text, label) feature names: supervised keys, else the first text feature."""
    if info.supervised_keys:
        text_key, label_key = info.supervised_keys[:2]
        return text_key, label_key
    features = info.features
    text_keys = [name for name, feature in features.items() if feature.dtype == tf.string]
    if not text_keys or "label" not in features:
        raise ValueError(
            f"`dataset` must have a text feature and a `label`. Received: dataset="
            f"{info.full_name!r} with features {sorted(features)}"
        )
    return text_keys[0], "label"


@keras.saving.register_keras_serializable(package="apps")
def standardize(text):
    """Lower-cases, drops HTML line breaks and punctuation; invalid UTF-8 becomes U+FFFD.

    This runs inside the exported SavedModel too, so raw bytes from anywhere (invalid
    UTF-8, emoji) go in without an error.
    """
    text = tf.strings.unicode_transcode(
        text, "UTF-8", "UTF-8", errors="replace", replace_control_characters=True
    )
    text = tf.strings.lower(text, encoding="utf-8")
    text = tf.strings.regex_replace(text, r"<br\s*/?>", " ")
    # Keep letters, digits and apostrophes inside words ("don't"); split the rest.
    text = tf.strings.regex_replace(text, r"[^\pL\pN']+", " ")
    return tf.strings.regex_replace(text, r"(^|\s)'+|'+(\s|$)", " ")


def make_vectorizer(vocab_size, sequence_length, vocabulary=None):
    """A `TextVectorization` layer: raw strings to `(B, sequence_length)` token ids, 0 = pad."""
    return keras.layers.TextVectorization(
        max_tokens=vocab_size,
        output_sequence_length=sequence_length,
        standardize=standardize,
        vocabulary=vocabulary,
        name="vectorizer",
    )


def vectorize(vectorizer, texts, batch_size=1024):
    """Token ids `(len(texts), sequence_length)` int32 for an array of raw texts."""
    ds = tf.data.Dataset.from_tensor_slices(texts).batch(batch_size).map(vectorizer)
    return np.concatenate([batch.numpy() for batch in ds]).astype("int32")


def token_lengths(ids):
    """Each row's length up to its last token `(n,)` (TextVectorization pads at the end)."""
    ids = np.asarray(ids)
    present = ids != 0
    last = ids.shape[1] - np.argmax(present[:, ::-1], axis=1)
    return np.where(present.any(axis=1), last, 0).astype("int32")


def read_ngrams(vectorizer, path):
    """The word n-grams of `bigrams.txt` or `trigrams.txt` ("not good" per line) as id tuples,
    `(previous, word)` or `(second, previous, word)`."""
    index = {word: i for i, word in enumerate(vectorizer.get_vocabulary())}
    with open(path, encoding="utf-8") as f:
        return [tuple(index[word] for word in line.split(" ")) for line in f.read().splitlines()]

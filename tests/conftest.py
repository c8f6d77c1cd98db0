import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The app's tests read IMDB through TFDS. On the project's machines it is prepared at
# ../shared/data/tensorflow_datasets (no network); elsewhere TFDS downloads it.
_SHARED_TFDS = os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "data", "tensorflow_datasets"
)
if "TFDS_DATA_DIR" not in os.environ and os.path.isdir(_SHARED_TFDS):
    os.environ["TFDS_DATA_DIR"] = os.path.abspath(_SHARED_TFDS)

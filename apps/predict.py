"""`python -m apps.predict`: classifies raw text with an exported SavedModel (TensorFlow only).

The command keeps its name (the README, the model cards and `metrics.json` cite it); its code
is `apps/serving/predict.py`.
"""

import sys

from .serving.predict import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m apps.train_sentiment`: trains the sentiment classifier, exports it and reports.

The command keeps its name (the README, the model cards and `metrics.json` cite it); its code
is `apps/training/train.py`.
"""

import sys

from .training.train import main

if __name__ == "__main__":
    sys.exit(main())

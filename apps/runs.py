"""`python -m apps.runs`: loads a finished run back and re-exports its SavedModel.

The command keeps its name (the README, the model cards and `metrics.json` cite it); its code
is `apps/training/runs.py`.
"""

import sys

from .training.runs import main

if __name__ == "__main__":
    sys.exit(main())

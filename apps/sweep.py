"""`python -m apps.sweep`: trains one configuration over seeds and summarises them.

The command keeps its name (the README, the model cards and `metrics.json` cite it); its code
is `apps/training/sweep.py`.
"""

import sys

from .training.sweep import main

if __name__ == "__main__":
    sys.exit(main())

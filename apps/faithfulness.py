"""`python -m apps.faithfulness`: the deletion tests of a run's attention and gradients.

The command keeps its name (the README, the model cards and `metrics.json` cite it); its code
is `apps/inspection/faithfulness.py`.
"""

import sys

from .inspection.faithfulness import main

if __name__ == "__main__":
    sys.exit(main())

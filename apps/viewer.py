"""`python -m apps.viewer`: opens a run's attention in the viewer page.

The command keeps its name (the README, the model cards and `metrics.json` cite it); its code
is `apps/inspection/viewer.py`.
"""

import sys

from .inspection.viewer import main

if __name__ == "__main__":
    sys.exit(main())

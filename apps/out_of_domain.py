"""`python -m apps.out_of_domain`: the classifier on short texts from outside IMDB (tweets,
product reviews, news editorials), each labelled one sentence at a time.

Its code is `apps/inspection/out_of_domain.py`.
"""

import sys

from .inspection.out_of_domain import main

if __name__ == "__main__":
    sys.exit(main())

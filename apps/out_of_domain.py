"""`python -m apps.out_of_domain`: the classifier on short texts from outside IMDB (tweets,
product reviews, news editorials), each labelled one sentence at a time.

Its code is `apps/training/out_of_domain.py`.
"""

import sys

from .training.out_of_domain import main

if __name__ == "__main__":
    sys.exit(main())

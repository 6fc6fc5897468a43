"""``python -m mpidist``: the same as the ``mpidist`` console script."""

import sys

from .cli import main

sys.exit(main())

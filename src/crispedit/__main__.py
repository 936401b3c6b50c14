"""``python -m crispedit``: the command line (what ``torchrun ... -m crispedit`` launches)."""

import sys

from .cli import main

sys.exit(main())

"""``python -m crosscut.cli``: the same entry point as the ``crosscut`` console script."""

import sys

from crosscut.cli.commands import main

sys.exit(main())

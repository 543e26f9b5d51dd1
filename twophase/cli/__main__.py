"""``python -m twophase.cli``: the same as the ``twophase`` command."""

import sys

from twophase.cli import main

sys.exit(main())

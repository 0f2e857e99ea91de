"""``python -m mixers``: the ``ssm-pack`` command (``report`` by default, ``demo``)."""

import sys

from .cli import main

sys.exit(main())

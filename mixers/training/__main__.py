"""``python -m mixers.training`` (what torchrun runs): the same as ``ssm-pack train``."""

import sys

from .train import main

sys.exit(main())

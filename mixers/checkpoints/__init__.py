"""Converters between upstream layers' checkpoints and our mixers (see docs/checkpoints.md).

``SOURCES`` names every upstream layout; ``from_module`` / ``from_state_dict`` build our mixer,
``to_state_dict`` / ``to_module`` go back; ``load_checkpoint`` / ``select`` read files safely.
"""

from ._source import Source
from .convert import SOURCES, from_module, from_state_dict, source_of, to_module, to_state_dict
from .io import load_checkpoint, select

__all__ = ["SOURCES", "Source", "from_module", "from_state_dict", "load_checkpoint", "select", "source_of",
           "to_module", "to_state_dict"]

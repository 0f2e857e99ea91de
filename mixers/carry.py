"""``CarriedStates`` at the import path the docs first gave it (defined in :mod:`mixers.model.carry`)."""

from .model.carry import CarriedStates

__all__ = ["CarriedStates"]

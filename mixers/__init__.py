"""Mixer ops and layers for packed hybrid models (see README)."""

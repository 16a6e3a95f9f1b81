"""Models: the decode forward of each architecture (registry.py picks one), built from shared blocks."""

"""Test and benchmark helpers (random-weight checkpoints); not used by serving code."""

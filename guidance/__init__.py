"""Guided decoding shared by the coordinator (checks) and the workers (masks): llguidance grammars."""

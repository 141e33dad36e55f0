"""Speculative decoding on a decode worker: drafts from a request's own text (and the coordinator's hints), verified
in one forward by the engine (no torch here: settings, proposers, the per-request drafting state)."""

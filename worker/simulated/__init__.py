"""The simulated backend: engines with no model (and no torch) behind the same servicers as the real ones.

Forwards take the time a CostModel says, tokens are synthetic, and KV streams are the real framing
of zero bytes sized as the configured model's cache. Light enough to run dozens of workers per core.
"""

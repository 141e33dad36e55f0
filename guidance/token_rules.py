"""Limits on per-token rules that the coordinator validates and the workers check again (torch-free)."""

from __future__ import annotations

LOGIT_BIAS_LIMIT = 100.0  # a bias is in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT], OpenAI's range
# Entries in one logit_bias table (OpenAI's cap): a table is added to every row of its request at every step.
MAX_LOGIT_BIAS_ENTRIES = 300

"""Moving a prompt's KV cache from a prefill worker to a decode worker."""

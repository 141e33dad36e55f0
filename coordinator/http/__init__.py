"""The coordinator's HTTP side: the predict and management listeners, their routes, API keys, TLS, error bodies."""

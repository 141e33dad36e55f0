"""Trust on every link: TLS material, API keys, worker and registration secrets (shared by coordinator and workers)."""

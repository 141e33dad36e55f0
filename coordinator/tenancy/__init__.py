"""Tenants: who a request is for (an API key, or a trusted gateway's fairness header), its limits and its
priority headers."""

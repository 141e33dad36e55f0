"""Instance selection: policies that pick a prefill and a decode instance for each request."""

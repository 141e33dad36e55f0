"""The coordinator: client APIs on HTTP, one prefill and one decode worker per request."""

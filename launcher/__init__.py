"""The `pdserve` command: coordinator, worker, local cluster, model builder."""

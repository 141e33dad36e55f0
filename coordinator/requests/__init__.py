"""One generation's life in the coordinator: the internal request, limits, the queue, the pipeline and its attempts, writing back."""

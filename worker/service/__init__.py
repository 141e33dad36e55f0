"""A worker process around one engine: the gRPC servicers, options, drain, registration and serve wiring."""

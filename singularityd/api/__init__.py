"""The API: the gRPC servicer over a small protocol, the per-user servers, the protos and stubs."""

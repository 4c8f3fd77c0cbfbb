"""The proxy's gRPC servicers: requests in, answers and the multiplexed stream out, health, retirement, metrics."""

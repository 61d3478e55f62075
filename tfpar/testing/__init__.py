"""What tfpar's own tests and benchmarks use: hosts in network namespaces (netns)."""

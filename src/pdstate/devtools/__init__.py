"""Developer tools behind the CLI: demo, worker processes, bench and its baselines."""

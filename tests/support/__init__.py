"""What the test modules share: engines and models to drive, oracles, workloads."""

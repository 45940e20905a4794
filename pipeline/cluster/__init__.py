"""Where workers run: pools in one SpecCluster, deployments, security."""

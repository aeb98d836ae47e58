"""What the tests share: the repository, the CLI, ranks, clusters, journeys."""

"""Small subcommands of the `hicache` CLI that belong to no larger module."""

"""Running services on a cluster (`--scheduler ray`): imported only on that path."""

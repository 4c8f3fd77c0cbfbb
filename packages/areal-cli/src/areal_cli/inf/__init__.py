"""`areal inf`: the local inference service."""

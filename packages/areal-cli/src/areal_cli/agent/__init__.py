"""`areal agent`: the local agent service (lifecycle commands shared with `areal inf`)."""

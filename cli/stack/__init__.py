"""``sluicegate up``: the launcher that starts every service of the local stack, and the supervisor that keeps
them running."""

"""How the agent's flows are deployed: ``serve`` (embedded) and ``make run`` (local server)."""

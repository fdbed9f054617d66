"""The agent node on Prefect: the node fires its windows itself, Prefect records them.

``python -m flows.node`` runs one node (:mod:`flows.node`, a thin facade over the
parts: :mod:`flows.firing`, :mod:`flows.jobs`, :mod:`flows.outbox`,
:mod:`flows.recorder`, :mod:`flows.planner`, :mod:`flows.control`,
:mod:`flows.node_report`). Settings: :mod:`flows.settings`; the action table at
work: :mod:`flows.actions`. See docs/agent.md.
"""

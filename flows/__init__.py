"""The agent node on Prefect: the node fires its windows itself, Prefect records them.

``python -m flows.node`` runs one node (:mod:`flows.node`, a thin facade over the
parts: :mod:`flows.firing`, :mod:`flows.jobs` with :mod:`flows.launcher` and
:mod:`flows.shim`, :mod:`flows.outbox`, :mod:`flows.recorder`, :mod:`flows.planner`,
:mod:`flows.reconcile`, :mod:`flows.channel` and :mod:`flows.control`,
:mod:`flows.chain`, :mod:`flows.node_report`). Settings: :mod:`flows.settings`, the
action table's models in :mod:`flows.action_specs`; the action table at work:
:mod:`flows.actions`. See docs/agent.md.
"""

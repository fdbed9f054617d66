"""The agent node on Prefect: the node fires its windows itself, Prefect records them.

``python -m sched_node`` runs one node (:mod:`sched_node.node`, a thin facade over
the parts: the kit's firing loop (:mod:`sched_core.loop`), :mod:`sched_node.jobs` with
:mod:`sched_node.launcher` and :mod:`sched_node.shim`, :mod:`sched_node.outbox`,
:mod:`sched_node.recorder`, :mod:`sched_node.planner`, :mod:`sched_node.reconcile`,
:mod:`sched_node.channel` and :mod:`sched_node.control`, :mod:`sched_node.chain`,
:mod:`sched_node.node_report`). Settings: :mod:`sched_node.settings`, the action table's
models in :mod:`sched_core.action_specs`, its commands rendered and checked by
:mod:`sched_core.render` and run by :mod:`sched_node.actions`. See docs/agent.md.
"""

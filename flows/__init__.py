"""The Prefect flows of the agent: ``run-job``, ``reconcile`` and ``chain`` (deployed by
``prefect.yaml``, one deployment of each per node, in the node's work pool).

At a window the node runs the job itself and records it as a run of ``run-job`` (it fires on
time while the Prefect server is down; Prefect's engine is never in a window's path). When
Prefect's engine runs one of these flows (a worker, ``prefect flow-run execute``,
``run_deployment``, a call in Python), the flow hands the work to the node process on its
host (:mod:`sched_node.local`) and follows it to its end; with no node there it fails,
saying so. See docs/agent.md, "The flows".
"""

"""The agent on Prefect: thin flows over sched_core.

- ``flows.tick.fire_tick`` (``fire-tick``): one tick per minute, each fire a run-job run.
- ``flows.reconcile.reconcile`` (``reconcile``): pull with retries, missed-run check.
- ``flows.job.run_job`` (``run-job``): one action of one schedule and window.
- ``flows.chain.advance_chain`` (``advance-chain``): job completions into the Chain.

Settings: :mod:`flows.settings`; the action table at work: :mod:`flows.actions`;
the Prefect API (dispatch, job registry, events): :mod:`flows.agent`. See docs/agent.md.
"""

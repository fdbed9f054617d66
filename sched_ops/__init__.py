"""The operator's side of the fleet: the ``sched`` commands that talk to a controller and Prefect.

Rule: this package is a client. It speaks to the controller over HTTP only
(the API in docs/controller.md and docs/operations.md) and to Prefect through Prefect's
client; it imports ``sched_core`` for words and times, and nothing of
``controller``, ``flows`` or ``deployments`` (``tests/test_layering.py``).

| module | what |
|---|---|
| ``client.py`` | the controller's HTTP API, its errors as exit codes |
| ``render.py`` | pure: tables, times and durations for people, safe cells |
| ``cli.py`` | the commands: ``nodes``, ``schedules ...``, ``upcoming``, ``report``, |
| | ``explain``, ``run``, ``alerts`` |
| ``alerts.py`` | the Prefect automations ``sched alerts install`` keeps in place |
"""

"""The parts of ``scripts/scaled.py`` (the scaled layout on one machine), one module each.

:mod:`~scripts.scaled_parts.procs` (processes, ports, errors),
:mod:`~scripts.scaled_parts.config` (settings, ports, ``layout.json``),
:mod:`~scripts.scaled_parts.postgres`, :mod:`~scripts.scaled_parts.balancer` (Redis and
HAProxy) and :mod:`~scripts.scaled_parts.services` (Prefect and the controllers);
``scripts/scaled.py`` starts, stops and shows them.
"""

"""How the project runs on Prefect: the agent's flows deployed (``serve`` embedded, ``make run``
a local server), and the scaled layout's Redis broker for Prefect (:mod:`.redis_messaging`)."""

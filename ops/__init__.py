"""What runs beside the product, from a checkout, and is not in the wheel: ``make run``'s local
Prefect server and node (:mod:`.run_local`), the scaled layout's Redis broker for Prefect
(:mod:`.redis_messaging`, loaded by the layout's Prefect processes from the checkout) and a
systemd unit for a node (``sched-agent.service``)."""

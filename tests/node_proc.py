"""The real node process with a test's clock: ``python -m tests.node_proc``.

The same as ``python -m sched_node`` (settings from ``SCHED_CONFIG``, Prefect from
``PREFECT_API_URL``, stopped by SIGTERM), with the node's clock shifted by
``SCHED_TEST_OFFSET_S`` seconds, so a test that kills the process puts its windows
a few real seconds ahead. Only the tests run this module.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from datetime import UTC, datetime, timedelta

from sched_node.node import Node
from sched_node.prefect_api import PrefectApi
from sched_node.settings import load_settings


def main() -> int:
    """Run the node until SIGTERM with the shifted clock."""
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    offset = timedelta(seconds=float(os.environ.get("SCHED_TEST_OFFSET_S", "0")))
    node = Node(load_settings(), api=PrefectApi(),
                clock=lambda: datetime.now(UTC) + offset)
    signal.signal(signal.SIGTERM, lambda *_: node.stop())
    print(f"node-proc {os.getpid()} started", flush=True)
    node.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

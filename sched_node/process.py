"""The node's process: ``python -m sched_node`` (or ``sched agent``) runs one node.

Settings from ``SCHED_CONFIG`` and ``SCHED_*`` (:mod:`sched_node.settings`), Prefect from
``PREFECT_API_URL`` (or Prefect's profile); it runs until SIGTERM or SIGINT, which leave the
running jobs to their keepers (the next start follows them), and exits 2 on bad settings.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from sched_core import ConfigError
from sched_node import start_failure
from sched_node.node import Node
from sched_node.prefect_api import PrefectApi
from sched_node.settings import load_settings

log = logging.getLogger("sched_node.node")


def main(argv: list[str] | None = None) -> int:
    """Run the node until SIGTERM or SIGINT; exit 2 on bad settings."""
    logging.basicConfig(level=os.environ.get("SCHED_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO, URL included (with any user:password in it).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        settings = load_settings()
        api = PrefectApi()
    except ConfigError as exc:
        print(f"sched-agent: {exc}", file=sys.stderr)
        if start_failure.report(str(exc)):
            print("sched-agent: told the controller this node cannot start", file=sys.stderr)
        return 2
    node = Node(settings, api=api)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("stopping (signal %d): running jobs go on in their keepers", signum)
        node.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"sched-agent: node {settings.node_name} fires its windows from "
          f"{Path(settings.cache_path)}; records go to {api.shown_url} "
          "(stop with Ctrl-C or SIGTERM)", flush=True)
    node.run()
    return 0

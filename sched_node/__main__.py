"""``python -m sched_node`` runs one node (the same as ``sched agent``)."""

import sys

from sched_node.process import main

sys.exit(main())

"""The demo's check action: every archive of one repository reads back whole.

    python3 check-archives.py -- STATE_DIR REPO_ID

Reads each ``archive-<repo>-<YYYYMMDDTHHMMZ>.tar.gz`` in STATE_DIR to its end
(gzip's CRC and every tar member), printing one line per archive. Exits 1 when
an archive is corrupt, and when there is none at all: a check that finds
nothing to check has not checked anything, so it must not pass.
"""

from __future__ import annotations

import gzip
import re
import sys
import tarfile
from pathlib import Path


def main(argv: list[str]) -> int:
    """Check the archives; return the exit code."""
    args = argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if len(args) != 2:
        print("usage: check-archives.py -- STATE_DIR REPO_ID", file=sys.stderr)
        return 2
    folder, repo = Path(args[0]), args[1]
    name = re.compile(rf"archive-{re.escape(repo)}-\d{{8}}T\d{{4}}Z\.tar\.gz")
    archives = sorted(path for path in folder.iterdir() if name.fullmatch(path.name))
    if not archives:
        print(f"no archive of repository {repo} in {folder}: nothing was checked")
        return 1
    corrupt = 0
    for path in archives:
        try:
            with gzip.open(path) as stream:  # to gzip's end: its CRC and length are checked
                while stream.read(1 << 20):
                    pass
            with tarfile.open(path, "r:gz") as archive:
                members = archive.getmembers()  # every member's header
            print(f"{path.name}: OK ({len(members)} entries)")
        except (OSError, EOFError, tarfile.TarError) as exc:
            print(f"{path.name}: CORRUPT: {exc}")
            corrupt += 1
    print(f"{len(archives) - corrupt} of {len(archives)} archives of {repo} read back whole")
    return 1 if corrupt else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""The scaled layout's settings (scripts/scaled.py), without starting anything."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.scaled_parts.balancer import (
    CHECK_TIMEOUT_S,
    NODE_AGENT,
    QUEUE_S,
    RETRY_AFTER_S,
    haproxy_conf,
)
from scripts.scaled_parts.config import DEFAULT_DIR, ROOT, Layout, config_from_env, sized_for
from scripts.scaled_parts.procs import LayoutError
from scripts.scaled_parts.services import base_env


def test_the_controllers_connection_ceiling_is_a_setting() -> None:
    # A node's long poll holds a connection: 10,000 nodes need more than serve's 4,000.
    assert config_from_env({})["controller_max_connections"] == 4000
    config = config_from_env({"SCALED_CONTROLLER_MAX_CONNECTIONS": "12000"})
    assert config["controller_max_connections"] == 12000
    for bad in ("0", "many"):
        with pytest.raises(LayoutError, match="SCALED_CONTROLLER_MAX_CONNECTIONS"):
            config_from_env({"SCALED_CONTROLLER_MAX_CONNECTIONS": bad})


def test_the_balancer_may_be_several_processes_on_the_same_ports(tmp_path: Path) -> None:
    # A proxied connection holds two descriptors; a process's open-file limit caps how many
    # long polls one HAProxy holds. Each process binds both frontends' ports.
    config = config_from_env({"SCALED_LB_PROCESSES": "3"})
    layout = Layout(tmp_path)
    layout.create(config)
    assert layout.lb_names() == ["haproxy", "haproxy-2", "haproxy-3"]
    texts = {name: haproxy_conf(layout, name).read_text() for name in layout.lb_names()}
    binds = {name: sorted(line for line in text.splitlines() if line.strip().startswith("bind"))
             for name, text in texts.items()}
    assert len(binds["haproxy"]) == 3  # Prefect, controller, stats page
    for name in ("haproxy-2", "haproxy-3"):
        assert binds[name] == [b for b in binds["haproxy"] if "stats" not in b and
                               str(config["ports"]["lb_stats"]) not in b]
    sockets = {line.split()[2] for text in texts.values() for line in text.splitlines()
               if line.strip().startswith("stats socket")}
    assert len(sockets) == 3
    with pytest.raises(LayoutError, match="SCALED_LB_PROCESSES"):
        config_from_env({"SCALED_LB_PROCESSES": "0"})
    # A layout made before the setting: one process.
    del layout.state["config"]["lb_processes"]
    assert layout.lb_names() == ["haproxy"]


def test_a_busy_server_is_not_taken_out_but_a_dead_one_is(tmp_path: Path) -> None:
    # Each backend's health check waits CHECK_TIMEOUT_S for its answer (a busy API process
    # answered /api/health in over 2 s at a 10,000-node peak, both were marked down and
    # HAProxy answered 503 itself); a refused connection still fails a check at once.
    layout = Layout(tmp_path)
    layout.create(config_from_env({}))
    text = haproxy_conf(layout).read_text()
    backends = text.split("\nbackend ")[1:]
    assert [b.split()[0] for b in backends] == ["prefect_api", "prefect_streams",
                                                "controller_api"]
    for backend in (backends[0], backends[2]):  # the streams' servers track prefect_api's
        lines = [line.strip() for line in backend.split("\nfrontend ")[0].splitlines()]
        assert f"timeout check {CHECK_TIMEOUT_S}s" in lines
        assert "default-server inter 2s fall 2 rise 2" in lines
    assert CHECK_TIMEOUT_S >= 10


def test_the_default_layout_folder_is_the_checkouts_dot_scaled() -> None:
    """What `make scaled-up`, docs/scaled.md and bench/fleet_sim.py use, wherever it is run."""
    checkout = Path(__file__).resolve().parents[1]
    assert DEFAULT_DIR == checkout / ".scaled"
    assert (ROOT / "scripts" / "scaled.py").is_file()


def _imported_from(argv: list[str], cwd: Path, env: dict[str, str]) -> list[Path]:
    """Run argv (a Python that prints module files, one a line); return those files."""
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=True,
                          stdin=subprocess.DEVNULL)
    return [Path(line) for line in done.stdout.split()]


def test_the_layout_and_its_servers_run_this_checkouts_code(tmp_path: Path) -> None:
    # The venv's editable install may point at another checkout (a git worktree shares the
    # main one's venv): the script and the servers it starts must still run this one's code.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    as_script = ("import runpy, sys; runpy.run_path(sys.argv[1], run_name='probe');"
                 " import scripts.scaled_parts as m; print(m.__file__)")
    files = _imported_from([sys.executable, "-c", as_script, str(ROOT / "scripts/scaled.py")],
                           tmp_path, env)
    layout = Layout(tmp_path)
    layout.create(config_from_env({}))
    in_server = ("import ops.redis_messaging as a, sched_cli as b;"
                 " print(a.__file__); print(b.__file__)")
    files += _imported_from([sys.executable, "-c", in_server], tmp_path,
                            base_env(layout, tmp_path / "home"))
    assert len(files) == 3
    for file in files:
        assert file.is_relative_to(ROOT), file


def test_one_number_sizes_the_layout_for_its_fleet() -> None:
    # 10,000 nodes: each controller carries the whole fleet's long polls when the other is
    # gone; HAProxy's descriptors (two per connection) spread over processes.
    assert sized_for(10_000, open_files=20_000) == {
        "fleet": 10_000, "controller_max_connections": 11_000, "lb_maxconn": 12_000,
        "lb_processes": 2}
    assert sized_for(1_000, open_files=20_000)["lb_processes"] == 1
    assert sized_for(10_000, open_files=1 << 20)["lb_processes"] == 1
    config = config_from_env({"SCALED_FLEET": "10000"})
    assert config["controller_max_connections"] == 11_000
    # A size set alone wins over the fleet's.
    assert config_from_env({"SCALED_FLEET": "10000", "SCALED_LB_PROCESSES": "4"})[
        "lb_processes"] == 4
    with pytest.raises(LayoutError, match="SCALED_FLEET"):
        config_from_env({"SCALED_FLEET": "lots"})


def test_a_layout_is_resized_after_down_and_keeps_everything_else(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    layout.create(config_from_env({}))
    kept = dict(layout.config)
    # While it runs: refused, saying to run `down` first; nothing changes.
    with pytest.raises(LayoutError, match="run `down` first"):
        layout.check_env({"SCALED_FLEET": "10000"}, running=True)
    assert Layout(tmp_path).config == kept
    # Stopped: the sizes change and are kept; nothing else does.
    changed = layout.check_env({"SCALED_FLEET": "10000"}, running=False)
    assert set(changed) <= {"fleet", "controller_max_connections", "lb_maxconn",
                            "lb_processes"} and "fleet" in changed
    again = Layout(tmp_path).config
    assert again["fleet"] == 10_000 and again["controller_max_connections"] == 11_000
    assert {k: v for k, v in again.items() if k not in changed} == {
        k: v for k, v in kept.items() if k not in changed}
    # Anything else still needs `clean`.
    with pytest.raises(LayoutError, match="clean"):
        layout.check_env({"SCALED_API_COUNT": "3"}, running=False)


def test_prefects_balancer_queues_nodes_behind_people_and_never_queues_health(
        tmp_path: Path) -> None:
    # Each API process takes as many requests as its database pool has connections; the rest
    # wait in HAProxy (a 503 with Retry-After after QUEUE_S), the nodes' after everyone's.
    layout = Layout(tmp_path)
    layout.create(config_from_env({"SCALED_DB_POOL_SIZE": "10", "SCALED_DB_MAX_OVERFLOW": "5"}))
    conf = haproxy_conf(layout)
    text = conf.read_text()
    prefect = text[text.index("frontend prefect"):text.index("frontend controller")]
    api = prefect[prefect.index("\nbackend prefect_api"):prefect.index("\nbackend prefect_streams")]
    assert api.count("check maxconn 15") == 2 and f"timeout queue {QUEUE_S}s" in api
    assert f"-m beg {NODE_AGENT} }}" in prefect and "set-priority-class int(1)" in prefect
    assert f"set-header Retry-After {RETRY_AFTER_S} if {{ status 503 }}" in prefect
    # Event websockets are held for hours: not bound, their servers' health tracked.
    streams = prefect[prefect.index("\nbackend prefect_streams"):]
    assert "use_backend prefect_streams if { path_beg /api/events/in /api/events/out }" in prefect
    assert "maxconn" not in streams and streams.count("track prefect_api/") == 2
    # The controllers' long polls are not bound this way.
    assert "maxconn 15" not in text[text.index("frontend controller"):]
    if shutil.which("haproxy") is None:
        pytest.skip("no haproxy to check the file with (make test installs it)")
    checked = subprocess.run(["haproxy", "-c", "-f", str(conf)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr

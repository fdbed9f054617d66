"""The fleet page in a real headless browser (Debian's chromium and chromium-driver, selenium).

The controller is the real app on a SQLite file, served over loopback; the
browser logs in through the form, reads the tables and the timeline, and
checks what it loads (nothing but the page). The controller's clock is pinned
to the New York fall-back night of 2026-11-01 so the timeline has a DST shift.
Nodes a and b pull (their node tokens, ``GET /api/schedules``) and report
their latest jobs (``POST /api/nodes/{node}/report``) through the real API
two minutes before; node c never shows up.

``SCHED_SCREENSHOT=docs/fleet-page.png .venv/bin/pytest tests/test_fleet_page.py``
refreshes the screenshot kept in docs/.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.api.app import create_app
from controller.api.page import COOKIE
from controller.auth import Tokens
from controller.fleetpage import FleetView, render_page
from controller.testing import serve_in_thread
from tests.fixtures_pg import sqlite_engine

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,1400", "--hide-scrollbars"]
ADMIN, NODE = "page-admin-token", "page-node-token"
NOW = datetime(2026, 11, 1, 0, 0, tzinfo=UTC)  # 20:00 EDT; New York falls back at 06:00Z
PREFECT_UI = "http://127.0.0.1:4200"
FAILED_RUN = uuid.UUID("9b2f64c6-0d4e-4a3b-8f53-0b7c2b0f1a11")


def row(rid: str, name: str, action: str, schedule: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"id": rid, "name": name, "repo_id": "r-1", "action": action, "storage": "b2",
            "schedule": schedule, "miss_policy": "run-once-within-24h", "enabled": True,
            "params": {}, "version": 0, **extra}


FLEET = {
    "node-a": [row("a-backup", "nightly backup", "backup",
                   {"days": ["*"], "hours": ["1"], "minute": "30"}),
               row("a-copy", "copy <script>alert(1)</script>", "copy",
                   {"days": ["*"], "hours": ["0", "6", "12", "18"],
                    "minute": "15"})],
    "node-b": [row("b-backup", "backup every 4 h", "backup",
                   {"days": ["*"], "hours": ["2", "6", "10", "14", "18", "22"], "minute": "0"})],
    "node-c": [row("c-backup", "hourly backup", "backup", {"interval_minutes": 90})],
}


def report(node: str, latest: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A node's report (FLEET-CONTRACT.md point 1): each schedule's latest job as given."""
    return {"node": node, "agent_version": "0.1.0", "timezone": "America/New_York",
            "grace_s": 300, "reported_at": "2026-10-31T23:59:00Z",
            "last_pull": {"at": "2026-10-31T23:58:00Z", "ok": True, "error": None,
                          "status": "304"},
            "schedules": [{"id": rid, "last_fired": job["window"], "latest_job": job}
                          for rid, job in latest.items()],
            "counts": {"skipped": 0, "missed": 0}}


# What the nodes report: node-b's last backup failed; node-c never pulled nor reported.
REPORTS = {
    "node-a": report("node-a", {
        "a-backup": {"state": "Completed", "window": "2026-10-31T05:30:00Z",
                     "ended_at": "2026-10-31T05:31:00Z", "flow_run_id": str(uuid.uuid4()),
                     "flow_run_name": "backup-a-backup-20261031T0530Z"},
        "a-copy": {"state": "Completed", "window": "2026-10-31T22:15:00Z",
                   "ended_at": "2026-10-31T22:16:00Z", "flow_run_id": str(uuid.uuid4()),
                   "flow_run_name": "copy-a-copy-20261031T2215Z"}}),
    "node-b": report("node-b", {
        "b-backup": {"state": "Failed", "window": "2026-10-31T22:00:00Z",
                     "ended_at": "2026-10-31T22:03:10Z", "flow_run_id": str(FAILED_RUN),
                     "flow_run_name": "backup-b-backup-20261031T2200Z"}}),
}
TOKENS = {node: [f"{node}-token"] for node in FLEET}
WRITTEN = NOW - timedelta(days=1)  # the rows are a day old: their windows since are judged


def job(key: str, window: str, state: str, seq: int, **more: Any) -> dict[str, Any]:
    """A job record as node-b's agent (one that reports its jobs) sends it."""
    return {"key": key, "schedule_id": key.split("@")[0], "window": window,
            "trigger_key": "schedule", "state": state, "started_at": window,
            "ended_at": window.replace(":00:00Z", ":03:10Z"), "seq": seq, **more}


LONG_ERROR = ("tar exited with code 2: tar: /srv/data/projects/reports-2026"
              "/quarterly/a-very-long-directory-name-without-any-place-to-b"
              "reak-it-at-all-anywhere: Cannot open: No such file or directory")
"""A failure's why as long as a real one, with a word longer than any column."""
# node-b reports its jobs (a heartbeat announced): every window since the rows were written,
# the last one failed. node-a's agent reports none (an older one); node-c never shows up.
B_WINDOWS = ["2026-10-31T02:00:00Z", "2026-10-31T06:00:00Z", "2026-10-31T10:00:00Z",
             "2026-10-31T14:00:00Z", "2026-10-31T18:00:00Z"]
B_JOBS = [job(f"b-backup@{(datetime.fromisoformat(w) - timedelta(hours=4)):%Y-%m-%dT%H:%M}"
              "-04:00", w, "Completed", n) for n, w in enumerate(B_WINDOWS)] + [
    job("b-backup@2026-10-31T18:00-04:00", "2026-10-31T22:00:00Z", "Failed", 9,
        error=LONG_ERROR, flow_run_id=str(FAILED_RUN))]
REPORTS["node-b"] |= {"heartbeat_s": 60, "jobs": B_JOBS}


def _chromium_or_skip() -> None:
    missing = [pkg for pkg, path in (("chromium", CHROMIUM), ("chromium-driver", CHROMEDRIVER))
               if not Path(path).exists()]
    if missing:
        pytest.skip(f"Debian package {' and '.join(missing)} not installed "
                    "(make installs it when it can: scripts/system-packages.sh)")


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real controller, its clock pinned to NOW: rows put, nodes a and b pull and report."""
    with sqlite_engine(tmp_path_factory.mktemp("page-controller")) as engine:
        clock = {"now": WRITTEN}
        app = create_app(engine, Tokens([ADMIN], {**TOKENS, "node-a": [NODE, *TOKENS["node-a"]]}),
                         clock=lambda: clock["now"])
        with serve_in_thread(app) as base:
            auth = {"authorization": f"Bearer {ADMIN}"}
            for node, rows in FLEET.items():
                for item in rows:
                    answer = httpx.put(f"{base}/api/nodes/{node}/schedules/{item['id']}",
                                       json=item, headers=auth)
                    assert answer.status_code == 200, answer.text
            clock["now"] = NOW - timedelta(minutes=2)
            for node, body in REPORTS.items():
                mine = {"authorization": f"Bearer {TOKENS[node][0]}"}
                pull = httpx.get(f"{base}/api/schedules", params={"node": node}, headers=mine)
                assert pull.status_code == 200, pull.text
                answer = httpx.post(f"{base}/api/nodes/{node}/report", json=body, headers=mine)
                assert answer.status_code == 204, answer.text
            app.state.pull_recorder.flush()
            clock["now"] = NOW
            app.state.prefect_ui = PREFECT_UI
            yield base
            app.state.pull_recorder.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    _chromium_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def submit(browser: Any, token: str) -> None:
    """Type token into the login form, submit it, and wait for the answer's page."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    field = browser.find_element(By.ID, "token")
    field.send_keys(token)
    browser.find_element(By.ID, "login").click()

    def replaced(_: Any) -> bool:
        # staleness_of, and Chromium's other word for the same thing mid-navigation.
        try:
            return bool(expected_conditions.staleness_of(field)(browser))
        except StaleElementReferenceException:
            return True
        except WebDriverException as exc:
            if "does not belong to the document" in str(exc):
                return True
            raise

    WebDriverWait(browser, 15).until(replaced)


def test_the_page_needs_the_admin_and_never_puts_the_token_in_a_url_or_cookie(
    page: str, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    browser.delete_all_cookies()
    browser.get(page + "/")
    assert browser.find_elements(By.ID, "token"), "the login form"
    for token, message in (("nope", "unknown token"), (NODE, "not the admin's")):
        submit(browser, token)
        assert message in browser.find_element(By.ID, "login-error").text
    submit(browser, ADMIN)
    assert browser.find_elements(By.ID, "nodes"), browser.page_source[:500]
    assert ADMIN not in browser.current_url
    cookie = browser.get_cookie(COOKIE)
    assert cookie is not None and cookie["httpOnly"] and cookie.get("sameSite") == "Strict"
    assert ADMIN not in cookie["value"]
    # The cookie alone opens the page; a forged one does not.
    assert httpx.get(page + "/", cookies={COOKIE: cookie["value"]}).status_code == 200
    forged = cookie["value"][:-4] + ("AAAA" if not cookie["value"].endswith("AAAA") else "BBBB")
    assert httpx.get(page + "/", cookies={COOKIE: forged}).status_code == 401
    assert httpx.get(page + "/", headers={"authorization": f"Bearer {NODE}"}).status_code == 403
    assert httpx.get(page + "/docs").status_code == 404  # FastAPI's page loads from a CDN
    assert httpx.get(page + "/openapi.json").status_code == 200


def test_the_page_shows_nodes_schedules_and_the_timeline(page: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.get(page + "/")
    if not browser.find_elements(By.ID, "nodes"):
        submit(browser, ADMIN)
    nodes = browser.find_elements(By.CSS_SELECTOR, "#nodes tr")[1:]
    assert [r.find_elements(By.TAG_NAME, "td")[0].text for r in nodes] == list(FLEET)
    a, b, c = (r.text for r in nodes)
    assert "ok" in a and "America/New_York" in a and "0.1.0" in a
    assert "Sat 10-31 19:58 EDT 200" in a and "2 min ago" in a  # the pull the API recorded
    assert "failing" in b  # its report says its last backup failed
    assert "2 min ago (heartbeat 60 s)" in b and "never" in c  # seen: its own requests
    assert "never-seen" in c and "America/New_York (default)" in c
    assert "Never seen (no pull or report with its own token): node-c" in browser.find_element(
        By.TAG_NAME, "body").text

    # The morning report, as `sched report` prints it: the summary, then worst node first.
    assert browser.find_element(By.ID, "summary").text == (
        "0 of 3 nodes backed up (each schedule's latest window completed); 1 failing: node-b "
        f"b-backup failed 1 window since 2026-10-31 18:00 EDT, last: {LONG_ERROR}; "
        "0 missed; 1 silent: node-c (c-backup missed 16); "
        "1 unreported (an agent that reports no jobs): node-a")
    rows = [[td.text for td in r.find_elements(By.TAG_NAME, "td")]
            for r in browser.find_elements(By.CSS_SELECTOR, "#report tr")[1:]]
    assert [r[0] for r in rows] == ["node-c"] * 17 + ["node-b"] * 6 + ["node-a"] * 5
    assert rows[0][1].startswith("SILENT: node node-c has never made a request")
    assert rows[1][2:4] == ["2026-10-30 21:00 EDT", "MISSED: no report from the node"]
    assert rows[22][1:5] == ["b-backup", "2026-10-31 18:00 EDT", f"FAILED: {LONG_ERROR}",
                             "3 min 10 s"]
    # A long error keeps the table's shape: names, windows and durations never wrap, the
    # outcome is cut with an ellipsis and whole on hover (its title).
    table_rows = browser.find_elements(By.CSS_SELECTOR, "#report tr")
    failed_row, completed_row = table_rows[23], table_rows[18]
    cells = failed_row.find_elements(By.TAG_NAME, "td")
    assert failed_row.size["height"] < 1.5 * completed_row.size["height"], (
        "the failed window's row wrapped onto more lines than a completed one's")
    assert cells[3].get_dom_attribute("title") == f"FAILED: {LONG_ERROR}"
    assert cells[3].value_of_css_property("text-overflow") == "ellipsis"
    assert cells[3].size["width"] < browser.execute_script(
        "return arguments[0].scrollWidth", cells[3]), "the outcome is cut, not wrapped"
    assert rows[17][3] == "Completed" and rows[23][3] == "unreported"
    failed_link = browser.find_element(By.CSS_SELECTOR, "#report tr.failed a")
    assert failed_link.get_dom_attribute("href") == f"{PREFECT_UI}/runs/flow-run/{FAILED_RUN}"
    missed = browser.find_element(By.CSS_SELECTOR, "#report tr.missed td.bad")
    assert missed.value_of_css_property("color") in ("rgb(207, 34, 46)", "rgba(207, 34, 46, 1)")

    # One lane per node, New York's fall-back marked in every lane, the windows drawn.
    lanes = browser.find_elements(By.CSS_SELECTOR, "#timeline text.lane-label")
    assert [lane.text for lane in lanes] == list(FLEET)
    dst = browser.find_elements(By.CSS_SELECTOR, "#timeline g.dst title")
    assert len(dst) == 3 and all("clocks -1h" in d.get_attribute("textContent") for d in dst)
    windows = browser.find_elements(By.CSS_SELECTOR, "#timeline .window")
    assert len(windows) > 20
    moved = browser.find_elements(By.CSS_SELECTOR, "#timeline .window.dst-moved title")
    assert any("a-backup" in m.get_attribute("textContent") and "01:30 happens twice"
               in m.get_attribute("textContent") for m in moved)
    # node-b's failed run: red, linked to its run in the Prefect UI.
    failed = browser.find_element(By.CSS_SELECTOR, "#timeline rect.run.bad")
    assert failed.value_of_css_property("fill") == "rgb(207, 34, 46)"
    # Found from the document, not as the rect's parent: chromedriver answered that lookup
    # once with "Node with given id does not belong to the document" (an SVG parent).
    link = browser.find_element(By.CSS_SELECTOR, "#timeline a:has(> rect.run.bad)")
    assert link.get_dom_attribute("href") == f"{PREFECT_UI}/runs/flow-run/{FAILED_RUN}"

    tables = browser.find_elements(By.CSS_SELECTOR, "table.schedules")
    assert [t.get_attribute("data-node") for t in tables] == list(FLEET)
    node_b = tables[1].text
    assert "b-backup" in node_b and "Failed" in node_b
    assert "EDT" in tables[0].text  # next windows in the node's local time
    # A hostile name is text, not markup, and the page runs no script and loads nothing else.
    assert "copy <script>alert(1)</script>" in tables[0].text
    assert browser.find_elements(By.TAG_NAME, "script") == []
    assert browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)") == []

    shot = os.environ.get("SCHED_SCREENSHOT")
    target = Path(shot) if shot else Path(browser.capabilities["chrome"]["userDataDir"]) / "p.png"
    assert browser.save_screenshot(str(target))
    assert target.stat().st_size > 10_000

    button = browser.find_element(By.CSS_SELECTOR, "form[action='/logout'] button")
    button.click()
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 15).until(expected_conditions.staleness_of(button))
    assert browser.find_elements(By.ID, "token")


def test_the_page_escapes_every_value_and_links_only_run_ids() -> None:
    hostile = '"><img src=x onerror=alert(1)>'
    view = FleetView(now=NOW, prefect_ui=PREFECT_UI, nodes=[
        {"node": hostile, "schedules": 1, "status": "failing", "timezone": "../../etc/passwd"}],
        schedules={hostile: [{"id": "s", "name": hostile, "action": "backup", "enabled": True,
                              "when": hostile, "last_outcome": {
                                  "state": "Failed", "window": "2026-10-31T23:00:00Z",
                                  "flow_run_id": "javascript:alert(1)"}}]},
        windows=[{"node": hostile, "schedule_id": "s", "at": "2026-11-01T03:00:00Z",
                  "name": hostile, "note": hostile}])
    html = render_page(view)
    assert "<img" not in html and "javascript:" not in html
    assert "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in html  # Jinja2's spelling of &quot;


def test_the_templates_escape_every_value_and_refuse_a_name_they_are_not_given() -> None:
    import jinja2

    from controller.fleetpage import TEMPLATES

    assert TEMPLATES.from_string("{{ v }}").render(v="<b>") == "&lt;b&gt;"
    with pytest.raises(jinja2.UndefinedError):
        TEMPLATES.get_template("page.html").render()


def test_chromium_is_installed_where_make_can_install_it() -> None:
    """On a machine where make can install Debian packages, the browser test must not skip."""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("make cannot install Debian packages here (no apt-get, or not root)")
    assert Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(), (
        "make installs chromium and chromium-driver (SYSTEM_PACKAGES)")

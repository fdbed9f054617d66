"""The operator decides what Prefect may make a node do (``ad_hoc_runs``).

The voucher's rules as pure functions; then a real Prefect server, a real controller on
loopback and a node set to ``ad_hoc_runs = "controller"``: the UI's Run, Retry and Cancel
are refused on the run (saying why and what to do), ``sched run`` and ``sched cancel``
(with the controller's voucher) are taken, each voucher once.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from sched_cli import app as sched
from sched_core.vouchers import VoucherRefused, issue, token_key, verify
from sched_node.handoff import Handoff
from sched_node.prefect_api import new_state
from sched_node.vouch import CONTROLLER, PREFECT, Vouchers
from tests.nodekit import Prefect, final, row
from tests.procs import wait_for
from tests.test_node_controller import ADMIN_TOKEN, Center, center  # noqa: F401

T0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
KEY = token_key("node-a-secret-token-0123456789")


def _voucher(purpose: str = "run", subject: str = "s-1", *, node: str = "node-a",
             keys: list[bytes] | None = None, nonce: str = "n-1",
             expires: timedelta = timedelta(hours=1)) -> str:
    return issue(keys or [KEY], node=node, purpose=purpose, subject=subject,
                 expires_at=T0 + expires, nonce=nonce)


def test_a_voucher_vouches_for_exactly_its_node_purpose_and_subject_until_it_expires() -> None:
    found = verify(_voucher(), KEY, node="node-a", purpose="run", subject="s-1", now=T0)
    assert (found.node, found.purpose, found.subject, found.nonce) == (
        "node-a", "run", "s-1", "n-1")
    other = token_key("another-token-of-the-node-0123456")
    assert verify(_voucher(keys=[other, KEY]), KEY, node="node-a", purpose="run",
                  subject="s-1", now=T0).nonce == "n-1"  # one signature per token
    refused = {
        "no voucher from the controller": (None, {}),
        "for node 'node-b'": (_voucher(node="node-b"), {}),
        "for run 's-2', not run 's-1'": (_voucher(subject="s-2"), {}),
        "for cancel 's-1', not run 's-1'": (_voucher(purpose="cancel"), {}),
        "expired": (_voucher(expires=timedelta(seconds=-1)), {}),
        "signature is not the controller's": (_voucher(keys=[other]), {}),
        "not one the controller issues": ("v2.abc.def", {}),
        "too long": ("v1." + "a" * 3000, {}),
    }
    for why, (text, _) in refused.items():
        with pytest.raises(VoucherRefused, match=why.replace("(", r"\(").replace(")", r"\)")):
            verify(text, KEY, node="node-a", purpose="run", subject="s-1", now=T0)
    payload = _voucher().split(".")[1]
    tampered = f"v1.{payload[:-2]}xx.{_voucher().split('.')[2]}"
    with pytest.raises(VoucherRefused, match="signature"):
        verify(tampered, KEY, node="node-a", purpose="run", subject="s-1", now=T0)


def test_a_node_takes_each_voucher_once_and_keeps_what_it_took_across_a_restart(
        tmp_path: Path) -> None:
    def vouchers(mode: str = CONTROLLER) -> Vouchers:
        return Vouchers(tmp_path / "vouchers.json", node="node-a", mode=mode,
                        token=lambda: "node-a-secret-token-0123456789", clock=lambda: T0)

    assert vouchers(PREFECT).refusal(None, purpose="run", subject="s-1") is None
    first = vouchers()
    assert first.refusal(_voucher(), purpose="run", subject="s-1") is None
    again = vouchers().refusal(_voucher(), purpose="run", subject="s-1")
    assert again is not None and "the voucher was used already" in again
    assert "sched run" in again
    assert vouchers().refusal(_voucher(nonce="n-2"), purpose="run", subject="s-1") is None
    no_token = Vouchers(tmp_path / "v2.json", node="node-a", mode=CONTROLLER,
                        token=lambda: None, clock=lambda: T0)
    assert "no controller token" in str(no_token.refusal(_voucher(), purpose="run",
                                                          subject="s-1"))


def test_with_a_door_key_only_its_holder_hands_the_node_a_job(tmp_path: Path) -> None:
    handoff = Handoff(node="node-a", outbox=None, clock=lambda: T0,  # type: ignore[arg-type]
                      row=lambda sid: None, known=lambda: [], spec=lambda **kw: None,
                      start=lambda *a: None, wake=lambda: None,  # type: ignore[arg-type, return-value]
                      door_key="k" * 64)
    job, why = handoff.submit("s-1", None, None, None)
    assert job is None and why.startswith("refused: a flow run the node's own engine does not")
    job, why = handoff.submit("s-1", None, None, "x" * 64)
    assert job is None and "refused" in why
    job, why = handoff.submit("s-1", None, None, "k" * 64)
    assert job is None and why.startswith("no schedule 's-1'")  # past the key: the cache


def _vouch(at: Center, purpose: str, subject: str) -> str:
    answer = httpx.post(f"{at.base}/api/nodes/{at.node}/vouchers",
                        json={"purpose": purpose, "subject": subject},
                        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["voucher"])


def _ended(prefect: Prefect, run_id: str) -> dict[str, Any]:
    wait_for(f"run {run_id} to end", lambda: final(prefect.api.read_run(run_id)), 60)
    found = prefect.api.read_run(run_id)
    assert found is not None
    return found


@pytest.mark.prefect
def test_a_node_taking_only_vouched_runs_refuses_the_uis_and_takes_sched_runs_and_cancels(
        tmp_path: Path, center: Center, prefect_server: str,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sched_ops import prefect as ops

    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
    center.put(row("q-1", every=None, minute="7", hours=["3"]))
    center.put(row("q-long", every=None, minute="7", hours=["3"], sleep=120))
    node = center.node_of(tmp_path / "node", prefect_server, '\nad_hoc_runs = "controller"')
    prefect = Prefect(prefect_server)
    started = node.start()
    try:
        wait_for("the node's rows", lambda: len(started.scheduler.schedules()) == 2, 30)
        wait_for("the node's deployments", lambda: prefect.deployment(
            "run-job", center.node) is not None, 30)
        # The UI's Run: no voucher, so the run fails saying why and what to do instead.
        bare = _ended(prefect, prefect.create_run("run-job", center.node,
                                                  {"schedule_id": "q-1"}))
        assert bare["state"]["type"] == "FAILED", bare["state"]
        assert bare["state"]["message"].startswith("refused: no voucher from the controller")
        assert "sched run" in bare["state"]["message"]
        # sched run: the controller's voucher, taken once.
        ran = CliRunner().invoke(sched, ["run", "q-1", "--node", center.node, "--controller",
                                         center.base, "--token", ADMIN_TOKEN, "--json"])
        assert ran.exit_code == 0, ran.output
        vouched = _ended(prefect, json.loads(ran.stdout)["id"])
        assert vouched["state"]["type"] == "COMPLETED", vouched["state"]
        voucher = prefect.api.read_run(vouched["id"])["parameters"]["voucher"]  # type: ignore[index]
        again = _ended(prefect, ops.run_job(center.node, "q-1", voucher=voucher)["id"])
        assert "the voucher was used already" in again["state"]["message"], again["state"]
        other = _ended(prefect, ops.run_job(center.node, "q-1",
                                            voucher=_vouch(center, "run", "q-long"))["id"])
        assert "not run 'q-1'" in other["state"]["message"], other["state"]
        # The UI's Retry of the completed run: refused, and the run is Completed again.
        assert prefect.retry(vouched["id"]) == "ACCEPT"
        wait_for("the refused Retry", lambda: final(prefect.api.read_run(vouched["id"])), 60)
        back = prefect.api.read_run(vouched["id"])
        assert back is not None and back["state"]["type"] == "COMPLETED", back["state"]
        assert "the UI's Retry was refused" in back["state"]["message"]
        # A long job, vouched; the UI's Cancel is refused (the job runs on), sched cancel's
        # voucher stops it.
        long_id = ops.run_job(center.node, "q-long", voucher=_vouch(center, "run", "q-long"))["id"]
        wait_for("the long job running", lambda: (prefect.api.read_run(long_id) or {}).get(
            "state", {}).get("type") == "RUNNING", 60)
        prefect.api.set_state(long_id, new_state("CANCELLING", message="from the UI"),
                              force=False)
        started.control.check()
        wait_for("the refused cancel", lambda: (prefect.api.read_run(long_id) or {}).get(
            "state", {}).get("type") == "RUNNING", 60)
        bounced = prefect.api.read_run(long_id)
        assert bounced is not None
        assert bounced["state"]["message"].startswith("cancel refused: no voucher"), bounced
        time.sleep(1)
        assert started.adhoc.busy(long_id), "the refused cancel stopped the job"
        cancel = CliRunner().invoke(sched, ["cancel", long_id, "--node", center.node,
                                            "--controller", center.base, "--token", ADMIN_TOKEN])
        assert cancel.exit_code == 0, cancel.output
        assert "asked to cancel run" in cancel.output
        started.control.check()
        cancelled = _ended(prefect, long_id)
        assert cancelled["state"]["type"] == "CANCELLED", cancelled["state"]
    finally:
        node.stop()
        prefect.close()

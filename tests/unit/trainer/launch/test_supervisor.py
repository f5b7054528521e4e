"""EngineSupervisor over real child processes: a SIGKILLed engine is restarted (same command,
a new pid, the log appended), backoff doubles, restarts stop at max_restarts, an engine that
exits 0 is left alone, and `check` fails once fewer than min_engines remain or the gateway
died."""

import json
import os
import signal
import sys
import time

import pytest

from trainer.launch.processes import ProcessSet
from trainer.launch.supervisor import EngineSupervisor

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]


def _wait(cond, what, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _ups(procs, name):
    return procs.child(name).log_path.read_text().split().count("up")


def _kill(procs, name, ups=None):
    if ups is not None:  # it started and printed: a kill now is a death, not a failed start
        _wait(lambda: _ups(procs, name) == ups, f"{name} did not start")
    pid = procs.child(name).proc.pid
    os.killpg(pid, signal.SIGKILL)
    procs.child(name).proc.wait()
    return pid


def test_a_killed_engine_is_restarted_until_max_restarts(tmp_path):
    with ProcessSet(tmp_path / "logs", timeout_s=5) as procs:
        procs.start("gateway", SLEEPER, os.environ)
        for name in ("engine0", "engine1"):
            procs.start(name, SLEEPER, os.environ)
        sup = EngineSupervisor(
            procs, ["engine0", "engine1"], max_restarts=2, backoff_s=0.05, min_engines=1,
            poll_s=0.02,
        ).start()  # fmt: skip
        try:
            pids = [_kill(procs, "engine0", ups=1)]
            _wait(lambda: sup.restarts["engine0"] == 1, "no first restart")
            assert procs.child("engine0").proc.pid not in pids
            sup.check()  # one restarted, one alive: the run goes on
            pids.append(_kill(procs, "engine0", ups=2))
            _wait(lambda: sup.restarts["engine0"] == 2, "no second restart")
            _kill(procs, "engine0", ups=3)  # the third death: max_restarts=2 reached
            _wait(lambda: len(sup.history) == 3, "the third death was not seen")
            assert [r["restarted"] for r in sup.history] == [True, True, False]
            assert [r["status"] for r in sup.history] == [-9, -9, -9]
            assert sup.restarts == {"engine0": 2, "engine1": 0}
            assert sup.serving() == 1
            sup.check()  # min_engines=1: engine1 still serves
            rows = json.loads((tmp_path / "logs" / "children.json").read_text())
            assert rows["engine0"]["restarts"] == 2 and rows["engine0"]["status"] == -9
            assert rows["engine1"] == {
                "pid": procs.child("engine1").proc.pid, "restarts": 0, "status": None,
                "engine": True,
            }  # fmt: skip
            log_lines = (tmp_path / "logs" / "engine0.log").read_text().split()
            assert log_lines == ["up", "up", "up"]  # one log, appended by each start
            _kill(procs, "engine1")  # engine1's death is restarted; min_engines=2 fails now
            _wait(lambda: sup.restarts["engine1"] == 1, "engine1 not restarted")
            sup.min_engines = 2
            with pytest.raises(RuntimeError, match=r"expected at least launch.min_engines=2 "):
                sup.check()
        finally:
            sup.stop()


def test_clean_exits_are_not_restarted_and_a_dead_gateway_stops_the_run(tmp_path):
    quick = [sys.executable, "-c", "pass"]
    with ProcessSet(tmp_path / "logs", timeout_s=5) as procs:
        procs.start("gateway", SLEEPER, os.environ)
        procs.start("engine0", quick, os.environ)
        procs.start("engine1", SLEEPER, os.environ)
        with EngineSupervisor(procs, ["engine0", "engine1"], backoff_s=0.05, poll_s=0.02) as sup:
            procs.child("engine0").proc.wait()
            sup.check()
            assert sup.restarts == {"engine0": 0, "engine1": 0} and sup.history == []
            _kill(procs, "gateway")
            with pytest.raises(RuntimeError, match="gateway exited with status -9"):
                sup.check()


def test_backoff_doubles_and_restarts_can_be_off(tmp_path):
    with ProcessSet(tmp_path / "logs", timeout_s=5) as procs:
        procs.start("engine0", SLEEPER, os.environ)
        sup = EngineSupervisor(procs, ["engine0"], restart=False, poll_s=0.02)
        _kill(procs, "engine0")
        sup._tick()
        assert sup.history == [{"name": "engine0", "status": -9, "restarted": False}]
        with pytest.raises(RuntimeError, match=r"got 0: dead \{'engine0': -9\}"):
            sup.check()
        with pytest.raises(ValueError, match="expected max_restarts >= 0"):
            EngineSupervisor(procs, ["engine0"], max_restarts=-1)
    procs2 = ProcessSet(tmp_path / "logs2", timeout_s=5)
    try:
        procs2.start("engine0", SLEEPER, os.environ)
        sup = EngineSupervisor(procs2, ["engine0"], backoff_s=10.0, backoff_max_s=15.0)
        _kill(procs2, "engine0")
        sup._tick()
        first = sup._due["engine0"] - time.monotonic()
        assert 9.0 < first <= 10.0  # the first wait is backoff_s
        sup.restarts["engine0"] = 3  # three earlier restarts: 10 * 2**3 = 80, capped at 15
        del sup._due["engine0"]
        sup._tick()
        assert 14.0 < sup._due["engine0"] - time.monotonic() <= 15.0
    finally:
        procs2.stop_all()


def test_a_dead_engine_is_deregistered_on_the_gateway_at_once(tmp_path):
    """`deregister_dead` as `on_death`: the dead child's gateway engine (registered under its
    name by another client, as the engine process does: the launcher holds no engine key;
    silent but not disconnected: no long poll of it to break) is dropped through the trainer's
    client when the supervisor sees the death; its leased prompts go back to the queue."""
    from gateway import messages as m
    from gateway.client import GatewayClient
    from gateway.config import GatewayConfig, RunSettings
    from gateway.server import GatewayServer
    from protos import gateway_pb2 as gpb
    from trainer.launch.supervisor import deregister_dead

    tokens = {"trainer": "trainer-token-0123456789", "engine": "engine-token-0123456789"}
    srv = GatewayServer(
        GatewayConfig(settings=RunSettings(model_family="llama"), heartbeat_timeout_s=300.0), tokens
    )
    srv.start()
    trainer = GatewayClient(srv.address, tokens["trainer"])
    engine = GatewayClient(srv.address, tokens["engine"])
    try:
        spec = m.EngineSpec("jax", "llama", "float32", ("gloo",), name="engine0")
        eid = engine.register_engine(spec).engine_id
        srv.state.submit(gpb.SubmitRequest(prompts=[_prompt("p0"), _prompt("p1")]))
        assert len(engine.lease_prompts(eid, 2, 1.0).prompts) == 2
        with ProcessSet(tmp_path / "logs", timeout_s=5) as procs:
            procs.start("engine0", SLEEPER, os.environ)
            with EngineSupervisor(
                procs, ["engine0"], backoff_s=30.0, poll_s=0.02,
                on_death=deregister_dead(trainer),
            ):  # fmt: skip
                _kill(procs, "engine0", ups=1)
                _wait(lambda: srv.state.events.events("leases_requeued"), "not deregistered")
        (requeued,) = srv.state.events.events("leases_requeued")
        assert (requeued["engine"], requeued["prompts"]) == (eid, 2)
        reason = srv.state.events.events("dropped")[0]["reason"]
        assert reason == f"engine {eid!r} deregistered by the trainer (it exited)"
        assert trainer.status().engines == []
    finally:
        trainer.close()
        engine.close()
        srv.stop(0)


def _prompt(sid):
    from protos import rollout_pb2 as rpb

    return rpb.Prompt(
        sample_id=sid, token_ids=[1, 2], group_size=2,
        sampling=rpb.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4),
    )  # fmt: skip

"""Hypothesis: random call sequences and malformed fields against a real in-process server.

Properties: no call fails with INTERNAL or UNAVAILABLE (the server never crashes); every
refusal has an expected status code; prompts are conserved (pending + leased + ready =
submitted - fetched) after every step; no submission's group is ever fetched twice; a sample
id may be submitted again only once its group was fetched; and after a final drain, every
submission was fetched exactly once with G completions.
"""

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from gateway.client import GatewayClient
from gateway.config import GatewayConfig, RunSettings
from gateway.errors import GatewayError
from gateway.server import GatewayServer
from gateway.state import GatewayState
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc
from protos import rollout_pb2 as rpb

EXPECTED = {"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION"}


class GatewayMachine(RuleBasedStateMachine):
    """Drives one server through raw stubs (to send malformed messages) and a trainer client."""

    gw = None  # the builders, set by the test

    @initialize()
    def start(self):
        self.clock = self.gw.FakeClock()
        config = GatewayConfig(
            settings=RunSettings(model_family="llama"),
            lease_seconds=30.0,
            heartbeat_timeout_s=10.0,
            rollout_capacity=12,
            max_pending_prompts=40,
            max_wait_s=1.0,
        )
        state = GatewayState(config, clock=self.clock)
        self.srv = GatewayServer(config, self.gw.TOKENS, state=state).start()
        self.trainer = GatewayClient(self.srv.address, self.gw.TOKENS["trainer"], margin_s=5.0)
        self.engine_client = GatewayClient(self.srv.address, self.gw.TOKENS["engine"])
        self.stub = gateway_pb2_grpc.GatewayStub(self.engine_client._channel)
        self.next_id = 0
        self.submitted: dict[str, int] = {}  # sample id -> G of its latest submission
        self.times_submitted: Counter[str] = Counter()
        self.fetched: Counter[str] = Counter()
        self.engines: list[str] = []
        self.keys: dict[str, str] = {}  # engine id -> its engine_key
        self.leases: list[tuple[str, str, list[str]]] = []
        self.version = 0

    def teardown(self):
        if not hasattr(self, "srv"):
            return
        try:
            self._drain()
        finally:
            self.trainer.close()
            self.engine_client.close()
            self.srv.stop(0)

    def _call(self, name, request, role="engine"):
        client = self.trainer if role == "trainer" else self.engine_client
        self.last_code = ""
        if "engine_key" in request.DESCRIPTOR.fields_by_name:
            request.engine_key = self.keys.get(request.engine_id, "")
        try:
            reply = getattr(self.stub, name)(request, timeout=10, metadata=client._metadata)
            if name == "RegisterEngine" and reply.accepted:
                self.keys[reply.engine_id] = reply.engine_key
            return reply
        except Exception as e:  # grpc.RpcError
            code = e.code().name
            full = name == "SubmitPrompts" and code == "RESOURCE_EXHAUSTED"
            assert code in EXPECTED or full, f"{name} failed with {code}: {e.details()}"
            self.last_code = code
            engine_id = getattr(request, "engine_id", "")
            if code == "NOT_FOUND" and engine_id in self.engines:
                self.engines.remove(engine_id)  # dropped for missed heartbeats
            return None

    def _trainer(self, fn):
        try:
            return fn()
        except GatewayError as e:
            assert e.code in EXPECTED | {"RESOURCE_EXHAUSTED"}, e
            return None

    def _group(self, sid, g, bad):
        group = self.gw.group(sid, g=g, version=self.version)
        if bad == "count":
            del group.completions[-1]
        elif bad == "logprobs":
            group.completions[0].logprobs.append(-1.0)
        elif bad == "reason":
            group.completions[0].finish_reason = rpb.FINISH_REASON_UNSPECIFIED
        elif bad == "version":
            group.completions[0].version_end = self.version + 5
        return group

    @precondition(lambda self: len(self.engines) < 3)
    @rule()
    def register(self):
        reply = self._call("RegisterEngine", self.gw.register(name=f"e{len(self.engines)}"))
        assert reply is not None and reply.accepted
        self.engines.append(reply.engine_id)

    @rule(
        n=st.integers(1, 6),
        g=st.integers(1, 3),
        evals=st.integers(0, 6),
        bad=st.sampled_from([None] * 5 + ["g0", "empty", "dup", "nan"]),
    )
    def submit(self, n, g, evals, bad):
        prompts = []
        for i in range(n):
            self.next_id += 1
            prompts.append(self.gw.prompt(f"s{self.next_id}", g=g, is_eval=i < evals))
        if bad == "g0":
            prompts[-1].group_size = 0
        elif bad == "empty":
            del prompts[-1].token_ids[:]
        elif bad == "dup":
            flying = [s for s in self.submitted if self.times_submitted[s] > self.fetched[s]]
            done = [s for s in self.submitted if self.times_submitted[s] == self.fetched[s]]
            if flying:
                prompts[-1].sample_id = flying[0]
            elif done:  # fetched already: submitting it again is fine
                prompts[-1].sample_id = done[0]
        elif bad == "nan":
            prompts[-1].sampling.temperature = float("nan")
        q = self.trainer.status().queues
        fits = q.pending_eval + q.pending_train + n <= 40
        reply = self._call("SubmitPrompts", gpb.SubmitRequest(prompts=prompts), "trainer")
        flying = {s for s in self.submitted if self.times_submitted[s] > self.fetched[s]}
        valid = bad is None or (bad == "dup" and prompts[-1].sample_id not in flying)
        assert (reply is not None) == (valid and fits)
        if valid and not fits:
            assert self.last_code == "RESOURCE_EXHAUSTED"
        if reply is not None:
            self.submitted.update({p.sample_id: p.group_size for p in prompts})
            self.times_submitted.update(p.sample_id for p in prompts)

    @precondition(lambda self: self.engines)
    @rule(data=st.data(), n=st.sampled_from([0, 1, 2, 3, 5, 5]))
    def lease(self, data, n):
        eid = data.draw(st.sampled_from(self.engines + ["ghost"]))
        reply = self._call("LeasePrompts", gpb.LeaseRequest(engine_id=eid, max_prompts=n))
        if eid == "ghost" or n == 0:
            assert reply is None
        elif reply is not None and reply.lease_id:
            assert 1 <= len(reply.prompts) <= n
            self.leases.append((eid, reply.lease_id, [p.sample_id for p in reply.prompts]))

    @precondition(lambda self: self.leases)
    @rule(
        data=st.data(),
        bad=st.sampled_from([None, None, None, "count", "logprobs", "reason", "version"]),
    )
    def give_back(self, data, bad):
        eid, lease_id, sids = data.draw(st.sampled_from(self.leases))
        picked = data.draw(st.lists(st.sampled_from(sids), unique=True, max_size=len(sids)))
        released = data.draw(st.lists(st.sampled_from(sids), unique=True, max_size=len(sids)))
        released = [s for s in released if s not in picked]
        groups = [self._group(s, self.submitted[s], None) for s in picked]
        if bad and groups:
            groups[-1] = self._group(picked[-1], self.submitted[picked[-1]], bad)
        req = gpb.ReturnRequest(
            engine_id=eid, lease_id=lease_id, groups=groups, released_sample_ids=released
        )
        before = self.trainer.status().queues
        reply = self._call("ReturnRollouts", req)
        if reply is None or bad and groups:
            assert reply is None or reply.dropped == len(groups)
            after = self.trainer.status().queues
            assert after.ready_groups == before.ready_groups  # a refused return changes nothing
        else:
            assert reply.accepted + reply.dropped == len(groups)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def give_back_all(self, data):
        """Return every prompt of a lease, the common case (possibly late)."""
        eid, lease_id, sids = data.draw(st.sampled_from(self.leases))
        groups = [self._group(s, self.submitted[s], None) for s in sids]
        req = gpb.ReturnRequest(engine_id=eid, lease_id=lease_id, groups=groups)
        reply = self._call("ReturnRollouts", req)
        assert reply is None or reply.accepted + reply.dropped == len(groups)

    @rule(
        seconds=st.sampled_from([1.0, 6.0, 12.0, 31.0]), beat=st.sampled_from([True, True, False])
    )
    def advance(self, seconds, beat):
        self.clock.t += seconds
        if beat:
            for eid in self.engines:
                self._call("Heartbeat", gpb.HeartbeatRequest(engine_id=eid))
        self.srv.state.reap()

    @rule(n=st.integers(1, 8))
    def fetch(self, n):
        groups = self.trainer.fetch_rollouts(n, 0.0, min_groups=0)
        for g in groups:
            assert g.sample_id in self.submitted
            assert len(g.completions) == self.submitted[g.sample_id]
            assert g.prompt is not None and g.prompt.sample_id == g.sample_id
        self.fetched.update(g.sample_id for g in groups)

    @rule(step=st.integers(-1, 2))
    def publish(self, step):
        result = self._trainer(lambda: self.trainer.publish_version(self.version + step))
        assert (result is not None) == (step > 0)
        if result is not None:
            self.version += step

    @precondition(lambda self: self.engines)
    @rule(data=st.data(), delta=st.integers(-1, 1))
    def ack(self, data, delta):
        eid = data.draw(st.sampled_from(self.engines))
        version = self.version + delta
        phase = data.draw(st.sampled_from([1, 2, 2, 3, 0]))
        reply = self._call(
            "AckVersion", gpb.AckRequest(engine_id=eid, version=version, phase=phase)
        )
        if delta > 0 or phase == 0:
            assert reply is None

    @invariant()
    def conserved(self):
        if not hasattr(self, "srv"):
            return
        over = [s for s in self.fetched if self.fetched[s] > self.times_submitted[s]]
        assert not over, f"groups fetched more often than submitted: {over}"
        q = self.trainer.status().queues
        in_flight = q.pending_eval + q.pending_train + q.leased_prompts + q.ready_groups
        assert in_flight == self.times_submitted.total() - self.fetched.total()
        assert q.ready_groups + q.leased_prompts <= q.rollout_capacity

    def _drain(self):
        """A fresh engine (loaded to the current version) finishes everything left."""
        self.clock.t += 1000.0
        self.srv.state.reap()
        reg = self._call("RegisterEngine", self.gw.register(name="drain"))
        self._call(
            "AckVersion", gpb.AckRequest(engine_id=reg.engine_id, version=self.version, phase=2)
        )
        for _ in range(100):
            lease = self._call(
                "LeasePrompts", gpb.LeaseRequest(engine_id=reg.engine_id, max_prompts=50)
            )
            groups = [self._group(p.sample_id, p.group_size, None) for p in lease.prompts]
            if groups:
                self._call(
                    "ReturnRollouts",
                    gpb.ReturnRequest(
                        engine_id=reg.engine_id, lease_id=lease.lease_id, groups=groups
                    ),
                )
            fetched = self.trainer.fetch_rollouts(100, 0.0, min_groups=0)
            self.fetched.update(g.sample_id for g in fetched)
            if not groups and not fetched:
                break
        assert self.fetched == self.times_submitted, "prompts lost or duplicated"


def test_random_call_sequences_lose_and_duplicate_nothing(gw):
    GatewayMachine.gw = gw
    run_state_machine_as_test(
        GatewayMachine,
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )

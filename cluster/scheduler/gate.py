"""Which scheduler answers the nodes: the gate every call passes before it reaches a core.

A scheduler without standbys always has its core behind the gate. With the etcd store, the
core is there only while this scheduler leads (`Leadership.serving()`: its lease surely lives);
otherwise every call is refused with NotLeaderError naming the leader, which the servicer sends
as UNAVAILABLE with the leader's address in the trailing metadata (`cluster-leader`), or, for a
registration, as a Refusal REFUSAL_NOT_LEADER carrying it. UNAVAILABLE is gRPC's "try again,
possibly elsewhere": a client that knows no other address retries here, and one that does goes
to the leader at once.
"""

from __future__ import annotations

from cluster.protocol.errors import NotLeaderError
from cluster.protocol.leadership import Leadership, Role, Standing
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.refusals import RefusalLimiter


class Gate:
    def __init__(self, core: SchedulerCore | None, address: str = "") -> None:
        self.core = core
        self.address = address  # this scheduler's, as nodes reach it
        # Whether the job has no secret (anyone may join it): what is refused at the edge may
        # then name this scheduler's release (`cluster.protocol.version.refusal`). The job's
        # settings are its cores' for its whole life; without a core to read them from, the
        # job counts as having a secret.
        self.open_job = core is not None and core.settings.job_secret is None
        # None: no standbys, the core (if any) always answers.
        self.leadership: Leadership | None = None
        # With standbys: every scheduler of the job (host:port), and where the state is kept.
        self.schedulers: list[str] = []
        self.state_store = ""
        # Calls refused at the edge, before any core (`cluster.transport.edge`).
        self.refusals = RefusalLimiter()

    def current(self) -> SchedulerCore:
        """The core that answers now; NotLeaderError when this scheduler does not lead."""
        core = self.core
        if core is not None and core.fenced is None:
            leadership = self.leadership
            if leadership is None or leadership.serving():
                return core
        raise self.not_leader()

    def not_leader(self) -> NotLeaderError:
        leader = self.leader()
        if leader:
            where = f"the leader is at {leader}"
        else:
            where = "no scheduler leads right now (one takes over within the lease)"
        return NotLeaderError(f"not the leader: {where}", leader)

    def leader(self) -> str:
        """The leader's address when it is another scheduler ("" unknown or none)."""
        leadership = self.leadership
        if leadership is None or leadership.role is Role.LEADER:
            return ""
        return "" if leadership.leader == self.address else leadership.leader

    def standing(self) -> Standing:
        """This scheduler's part in the election, for Status."""
        leadership = self.leadership
        assert leadership is not None
        # A leader answers once its core is in (the job loaded and saved again), not before.
        core = self.core
        leading = core is not None and core.fenced is None and leadership.serving()
        return Standing(
            leading=leading,
            leader=self.address if leading else self.leader(),
            schedulers=tuple(self.schedulers),
            lease_s=leadership.lease_s,
            lease_left_s=leadership.lease_left_s(),
            state_store=self.state_store,
        )

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_WORKER: _ClassVar[Role]
    ROLE_SERVER: _ClassVar[Role]

class RefusalReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_UNSPECIFIED: _ClassVar[RefusalReason]
    REFUSAL_CLUSTER_FULL: _ClassVar[RefusalReason]
    REFUSAL_WORKER_NUM_MISMATCH: _ClassVar[RefusalReason]
    REFUSAL_FOREIGN_JOB: _ClassVar[RefusalReason]
    REFUSAL_INVALID_NODE: _ClassVar[RefusalReason]
    REFUSAL_JOB_OVER: _ClassVar[RefusalReason]
    REFUSAL_NOT_A_MEMBER: _ClassVar[RefusalReason]
    REFUSAL_UNAUTHENTICATED: _ClassVar[RefusalReason]
    REFUSAL_JOB_FINISHED: _ClassVar[RefusalReason]
    REFUSAL_VERSION_MISMATCH: _ClassVar[RefusalReason]
    REFUSAL_NODE_ALIVE: _ClassVar[RefusalReason]
    REFUSAL_NOT_LEADER: _ClassVar[RefusalReason]
    REFUSAL_STALE_CHALLENGE: _ClassVar[RefusalReason]

class ExchangeOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXCHANGE_UNSPECIFIED: _ClassVar[ExchangeOp]
    EXCHANGE_BARRIER: _ClassVar[ExchangeOp]
    EXCHANGE_ALLGATHER: _ClassVar[ExchangeOp]
    EXCHANGE_BROADCAST: _ClassVar[ExchangeOp]

class ExchangeRefusalReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXCHANGE_REFUSAL_UNSPECIFIED: _ClassVar[ExchangeRefusalReason]
    EXCHANGE_REFUSAL_MISMATCH: _ClassVar[ExchangeRefusalReason]
    EXCHANGE_REFUSAL_FINISHED: _ClassVar[ExchangeRefusalReason]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_WAITING: _ClassVar[Phase]
    PHASE_READY: _ClassVar[Phase]
    PHASE_FINISHED: _ClassVar[Phase]
    PHASE_FAILED: _ClassVar[Phase]

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_ALIVE: _ClassVar[NodeState]
    NODE_STATE_FAILED: _ClassVar[NodeState]
    NODE_STATE_FINISHED: _ClassVar[NodeState]

class SchedulerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULER_ROLE_UNSPECIFIED: _ClassVar[SchedulerRole]
    SCHEDULER_ROLE_LEADER: _ClassVar[SchedulerRole]
    SCHEDULER_ROLE_STANDBY: _ClassVar[SchedulerRole]
ROLE_UNSPECIFIED: Role
ROLE_WORKER: Role
ROLE_SERVER: Role
REFUSAL_UNSPECIFIED: RefusalReason
REFUSAL_CLUSTER_FULL: RefusalReason
REFUSAL_WORKER_NUM_MISMATCH: RefusalReason
REFUSAL_FOREIGN_JOB: RefusalReason
REFUSAL_INVALID_NODE: RefusalReason
REFUSAL_JOB_OVER: RefusalReason
REFUSAL_NOT_A_MEMBER: RefusalReason
REFUSAL_UNAUTHENTICATED: RefusalReason
REFUSAL_JOB_FINISHED: RefusalReason
REFUSAL_VERSION_MISMATCH: RefusalReason
REFUSAL_NODE_ALIVE: RefusalReason
REFUSAL_NOT_LEADER: RefusalReason
REFUSAL_STALE_CHALLENGE: RefusalReason
EXCHANGE_UNSPECIFIED: ExchangeOp
EXCHANGE_BARRIER: ExchangeOp
EXCHANGE_ALLGATHER: ExchangeOp
EXCHANGE_BROADCAST: ExchangeOp
EXCHANGE_REFUSAL_UNSPECIFIED: ExchangeRefusalReason
EXCHANGE_REFUSAL_MISMATCH: ExchangeRefusalReason
EXCHANGE_REFUSAL_FINISHED: ExchangeRefusalReason
PHASE_UNSPECIFIED: Phase
PHASE_WAITING: Phase
PHASE_READY: Phase
PHASE_FINISHED: Phase
PHASE_FAILED: Phase
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_ALIVE: NodeState
NODE_STATE_FAILED: NodeState
NODE_STATE_FINISHED: NodeState
SCHEDULER_ROLE_UNSPECIFIED: SchedulerRole
SCHEDULER_ROLE_LEADER: SchedulerRole
SCHEDULER_ROLE_STANDBY: SchedulerRole

class RegisterRequest(_message.Message):
    __slots__ = ("node_id", "role", "host", "port", "incarnation", "worker_num", "server_num", "cluster_id", "credential", "nonce", "proof", "spare", "challenge", "job_id", "call_seq", "collectives_generation", "collectives_answered", "protocol_revision", "cluster_version")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_NUM_FIELD_NUMBER: _ClassVar[int]
    SERVER_NUM_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_SEQ_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_GENERATION_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_ANSWERED_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_REVISION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: Role
    host: str
    port: int
    incarnation: int
    worker_num: int
    server_num: int
    cluster_id: str
    credential: bytes
    nonce: bytes
    proof: bytes
    spare: bool
    challenge: bytes
    job_id: str
    call_seq: int
    collectives_generation: int
    collectives_answered: int
    protocol_revision: int
    cluster_version: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., incarnation: _Optional[int] = ..., worker_num: _Optional[int] = ..., server_num: _Optional[int] = ..., cluster_id: _Optional[str] = ..., credential: _Optional[bytes] = ..., nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ..., spare: _Optional[bool] = ..., challenge: _Optional[bytes] = ..., job_id: _Optional[str] = ..., call_seq: _Optional[int] = ..., collectives_generation: _Optional[int] = ..., collectives_answered: _Optional[int] = ..., protocol_revision: _Optional[int] = ..., cluster_version: _Optional[str] = ...) -> None: ...

class ChallengeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChallengeResponse(_message.Message):
    __slots__ = ("challenge", "job_id", "ttl_s")
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    challenge: bytes
    job_id: str
    ttl_s: float
    def __init__(self, challenge: _Optional[bytes] = ..., job_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("reason", "message", "retry_after_s", "leader")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    reason: RefusalReason
    message: str
    retry_after_s: float
    leader: str
    def __init__(self, reason: _Optional[_Union[RefusalReason, str]] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[float] = ..., leader: _Optional[str] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("cluster_id", "registered", "expected", "rejoined", "generation", "heartbeat_interval_s", "node_timeout_s", "spare")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    REJOINED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    NODE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    registered: int
    expected: int
    rejoined: bool
    generation: int
    heartbeat_interval_s: float
    node_timeout_s: float
    spare: bool
    def __init__(self, cluster_id: _Optional[str] = ..., registered: _Optional[int] = ..., expected: _Optional[int] = ..., rejoined: _Optional[bool] = ..., generation: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., node_timeout_s: _Optional[float] = ..., spare: _Optional[bool] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("accepted", "refused")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    accepted: Accepted
    refused: Refusal
    def __init__(self, accepted: _Optional[_Union[Accepted, _Mapping]] = ..., refused: _Optional[_Union[Refusal, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node_id", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("hello", "register", "table_by_digest")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    TABLE_BY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    register: RegisterRequest
    table_by_digest: bool
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., register: _Optional[_Union[RegisterRequest, _Mapping]] = ..., table_by_digest: _Optional[bool] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("registered", "expected")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    registered: int
    expected: int
    def __init__(self, registered: _Optional[int] = ..., expected: _Optional[int] = ...) -> None: ...

class PeerTable(_message.Message):
    __slots__ = ("ranks", "node_ids", "hosts", "ports", "roles", "local_ranks", "local_sizes")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SIZES_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    hosts: _containers.RepeatedScalarFieldContainer[str]
    ports: _containers.RepeatedScalarFieldContainer[int]
    roles: _containers.RepeatedScalarFieldContainer[Role]
    local_ranks: _containers.RepeatedScalarFieldContainer[int]
    local_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranks: _Optional[_Iterable[int]] = ..., node_ids: _Optional[_Iterable[str]] = ..., hosts: _Optional[_Iterable[str]] = ..., ports: _Optional[_Iterable[int]] = ..., roles: _Optional[_Iterable[_Union[Role, str]]] = ..., local_ranks: _Optional[_Iterable[int]] = ..., local_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class TopologyReady(_message.Message):
    __slots__ = ("generation", "peers", "rollback_step", "reason", "delta_from", "changed_rows", "peers_zlib", "peers_digest")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FROM_FIELD_NUMBER: _ClassVar[int]
    CHANGED_ROWS_FIELD_NUMBER: _ClassVar[int]
    PEERS_ZLIB_FIELD_NUMBER: _ClassVar[int]
    PEERS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    generation: int
    peers: PeerTable
    rollback_step: int
    reason: str
    delta_from: int
    changed_rows: _containers.RepeatedScalarFieldContainer[int]
    peers_zlib: bytes
    peers_digest: bytes
    def __init__(self, generation: _Optional[int] = ..., peers: _Optional[_Union[PeerTable, _Mapping]] = ..., rollback_step: _Optional[int] = ..., reason: _Optional[str] = ..., delta_from: _Optional[int] = ..., changed_rows: _Optional[_Iterable[int]] = ..., peers_zlib: _Optional[bytes] = ..., peers_digest: _Optional[bytes] = ...) -> None: ...

class HostBeatsRequest(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Hello]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Hello, _Mapping]]] = ...) -> None: ...

class HostBeatsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Metadatum(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class HostAttach(_message.Message):
    __slots__ = ("slot", "request", "metadata")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    slot: int
    request: bytes
    metadata: _containers.RepeatedCompositeFieldContainer[Metadatum]
    def __init__(self, slot: _Optional[int] = ..., request: _Optional[bytes] = ..., metadata: _Optional[_Iterable[_Union[Metadatum, _Mapping]]] = ...) -> None: ...

class HostUp(_message.Message):
    __slots__ = ("attach", "detach", "finish", "batch")
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    attach: HostAttach
    detach: int
    finish: HostAttach
    batch: HostUps
    def __init__(self, attach: _Optional[_Union[HostAttach, _Mapping]] = ..., detach: _Optional[int] = ..., finish: _Optional[_Union[HostAttach, _Mapping]] = ..., batch: _Optional[_Union[HostUps, _Mapping]] = ...) -> None: ...

class HostUps(_message.Message):
    __slots__ = ("ups",)
    UPS_FIELD_NUMBER: _ClassVar[int]
    ups: _containers.RepeatedCompositeFieldContainer[HostUp]
    def __init__(self, ups: _Optional[_Iterable[_Union[HostUp, _Mapping]]] = ...) -> None: ...

class SlotEnd(_message.Message):
    __slots__ = ("slot", "code", "details", "trailing", "answer")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    slot: int
    code: int
    details: str
    trailing: _containers.RepeatedCompositeFieldContainer[Metadatum]
    answer: bytes
    def __init__(self, slot: _Optional[int] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., trailing: _Optional[_Iterable[_Union[Metadatum, _Mapping]]] = ..., answer: _Optional[bytes] = ...) -> None: ...

class HostDown(_message.Message):
    __slots__ = ("slots", "event", "ended")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    event: bytes
    ended: _containers.RepeatedCompositeFieldContainer[SlotEnd]
    def __init__(self, slots: _Optional[_Iterable[int]] = ..., event: _Optional[bytes] = ..., ended: _Optional[_Iterable[_Union[SlotEnd, _Mapping]]] = ...) -> None: ...

class PeerTableRequest(_message.Message):
    __slots__ = ("digest", "shared")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    digest: bytes
    shared: bool
    def __init__(self, digest: _Optional[bytes] = ..., shared: _Optional[bool] = ...) -> None: ...

class PeerTableResponse(_message.Message):
    __slots__ = ("peers_zlib", "shared_path")
    PEERS_ZLIB_FIELD_NUMBER: _ClassVar[int]
    SHARED_PATH_FIELD_NUMBER: _ClassVar[int]
    peers_zlib: bytes
    shared_path: str
    def __init__(self, peers_zlib: _Optional[bytes] = ..., shared_path: _Optional[str] = ...) -> None: ...

class NodeFailed(_message.Message):
    __slots__ = ("rank", "node_id", "reason", "generation")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    reason: str
    generation: int
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., reason: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("ok", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class SchedulerHeartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Event(_message.Message):
    __slots__ = ("progress", "topology_ready", "node_failed", "shutdown", "heartbeat", "accepted", "refused")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_READY_FIELD_NUMBER: _ClassVar[int]
    NODE_FAILED_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    progress: Progress
    topology_ready: TopologyReady
    node_failed: NodeFailed
    shutdown: Shutdown
    heartbeat: SchedulerHeartbeat
    accepted: Accepted
    refused: Refusal
    def __init__(self, progress: _Optional[_Union[Progress, _Mapping]] = ..., topology_ready: _Optional[_Union[TopologyReady, _Mapping]] = ..., node_failed: _Optional[_Union[NodeFailed, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., heartbeat: _Optional[_Union[SchedulerHeartbeat, _Mapping]] = ..., accepted: _Optional[_Union[Accepted, _Mapping]] = ..., refused: _Optional[_Union[Refusal, _Mapping]] = ...) -> None: ...

class ExchangeRequest(_message.Message):
    __slots__ = ("node_id", "generation", "seq", "op", "root", "value", "withdrawn", "value_bytes", "value_sha256")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWN_FIELD_NUMBER: _ClassVar[int]
    VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VALUE_SHA256_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    generation: int
    seq: int
    op: ExchangeOp
    root: int
    value: bytes
    withdrawn: str
    value_bytes: int
    value_sha256: bytes
    def __init__(self, node_id: _Optional[str] = ..., generation: _Optional[int] = ..., seq: _Optional[int] = ..., op: _Optional[_Union[ExchangeOp, str]] = ..., root: _Optional[int] = ..., value: _Optional[bytes] = ..., withdrawn: _Optional[str] = ..., value_bytes: _Optional[int] = ..., value_sha256: _Optional[bytes] = ...) -> None: ...

class ExchangeResponse(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExchangeRefusal(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: ExchangeRefusalReason
    def __init__(self, reason: _Optional[_Union[ExchangeRefusalReason, str]] = ...) -> None: ...

class KvSetRequest(_message.Message):
    __slots__ = ("key", "value", "value_bytes", "value_sha256")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VALUE_SHA256_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    value_bytes: int
    value_sha256: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., value_bytes: _Optional[int] = ..., value_sha256: _Optional[bytes] = ...) -> None: ...

class KvSetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvGetRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class KvGetResponse(_message.Message):
    __slots__ = ("values", "missing")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    missing: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[bytes]] = ..., missing: _Optional[_Iterable[str]] = ...) -> None: ...

class KvWaitRequest(_message.Message):
    __slots__ = ("keys", "timeout_s")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class KvWaitResponse(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KvAddRequest(_message.Message):
    __slots__ = ("key", "amount", "add_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    ADD_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    amount: int
    add_id: int
    def __init__(self, key: _Optional[str] = ..., amount: _Optional[int] = ..., add_id: _Optional[int] = ...) -> None: ...

class KvAddResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "failure")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    failure: str
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., failure: _Optional[str] = ...) -> None: ...

class FinishResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportCheckpointsRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "steps", "resumed", "generation", "report_seq")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REPORT_SEQ_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    steps: _containers.RepeatedScalarFieldContainer[int]
    resumed: MemoryResume
    generation: int
    report_seq: int
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., steps: _Optional[_Iterable[int]] = ..., resumed: _Optional[_Union[MemoryResume, _Mapping]] = ..., generation: _Optional[int] = ..., report_seq: _Optional[int] = ...) -> None: ...

class MemoryResume(_message.Message):
    __slots__ = ("generation", "step", "why")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    why: str
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., why: _Optional[str] = ...) -> None: ...

class ReportCheckpointsResponse(_message.Message):
    __slots__ = ("held_by_all",)
    HELD_BY_ALL_FIELD_NUMBER: _ClassVar[int]
    held_by_all: int
    def __init__(self, held_by_all: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "role", "rank", "host", "port", "state", "seconds_since_heartbeat", "incarnation", "restarts", "connected", "checkpoints", "spare")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: Role
    rank: int
    host: str
    port: int
    state: NodeState
    seconds_since_heartbeat: float
    incarnation: int
    restarts: int
    connected: bool
    checkpoints: _containers.RepeatedScalarFieldContainer[int]
    spare: bool
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., rank: _Optional[int] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., state: _Optional[_Union[NodeState, str]] = ..., seconds_since_heartbeat: _Optional[float] = ..., incarnation: _Optional[int] = ..., restarts: _Optional[int] = ..., connected: _Optional[bool] = ..., checkpoints: _Optional[_Iterable[int]] = ..., spare: _Optional[bool] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("cluster_id", "phase", "generation", "worker_num", "server_num", "nodes", "uptime_s", "recovery", "detail", "rollback_step", "saving", "leadership", "memory_resume")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_NUM_FIELD_NUMBER: _ClassVar[int]
    SERVER_NUM_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_STEP_FIELD_NUMBER: _ClassVar[int]
    SAVING_FIELD_NUMBER: _ClassVar[int]
    LEADERSHIP_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RESUME_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    phase: Phase
    generation: int
    worker_num: int
    server_num: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    uptime_s: float
    recovery: bool
    detail: str
    rollback_step: int
    saving: StateSaving
    leadership: Leadership
    memory_resume: MemoryResume
    def __init__(self, cluster_id: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., generation: _Optional[int] = ..., worker_num: _Optional[int] = ..., server_num: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., recovery: _Optional[bool] = ..., detail: _Optional[str] = ..., rollback_step: _Optional[int] = ..., saving: _Optional[_Union[StateSaving, _Mapping]] = ..., leadership: _Optional[_Union[Leadership, _Mapping]] = ..., memory_resume: _Optional[_Union[MemoryResume, _Mapping]] = ...) -> None: ...

class Leadership(_message.Message):
    __slots__ = ("role", "leader", "schedulers", "lease_s", "lease_left_s", "state_store")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    SCHEDULERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    STATE_STORE_FIELD_NUMBER: _ClassVar[int]
    role: SchedulerRole
    leader: str
    schedulers: _containers.RepeatedScalarFieldContainer[str]
    lease_s: float
    lease_left_s: float
    state_store: str
    def __init__(self, role: _Optional[_Union[SchedulerRole, str]] = ..., leader: _Optional[str] = ..., schedulers: _Optional[_Iterable[str]] = ..., lease_s: _Optional[float] = ..., lease_left_s: _Optional[float] = ..., state_store: _Optional[str] = ...) -> None: ...

class StateSaving(_message.Message):
    __slots__ = ("error", "failing_for_s", "failures", "unsaved_changes")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILING_FOR_S_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    UNSAVED_CHANGES_FIELD_NUMBER: _ClassVar[int]
    error: str
    failing_for_s: float
    failures: int
    unsaved_changes: int
    def __init__(self, error: _Optional[str] = ..., failing_for_s: _Optional[float] = ..., failures: _Optional[int] = ..., unsaved_changes: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("follow", "after_seq")
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    follow: bool
    after_seq: int
    def __init__(self, follow: _Optional[bool] = ..., after_seq: _Optional[int] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("seq", "time", "event", "fields_json")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    FIELDS_JSON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time: float
    event: str
    fields_json: str
    def __init__(self, seq: _Optional[int] = ..., time: _Optional[float] = ..., event: _Optional[str] = ..., fields_json: _Optional[str] = ...) -> None: ...

class HopUp(_message.Message):
    __slots__ = ("call", "start", "message", "done_writing", "cancel", "ping")
    CALL_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_WRITING_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    call: int
    start: HopStart
    message: bytes
    done_writing: bool
    cancel: bool
    ping: bool
    def __init__(self, call: _Optional[int] = ..., start: _Optional[_Union[HopStart, _Mapping]] = ..., message: _Optional[bytes] = ..., done_writing: _Optional[bool] = ..., cancel: _Optional[bool] = ..., ping: _Optional[bool] = ...) -> None: ...

class HopStart(_message.Message):
    __slots__ = ("method", "metadata", "timeout_s", "message", "schedulers")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULERS_FIELD_NUMBER: _ClassVar[int]
    method: str
    metadata: _containers.RepeatedCompositeFieldContainer[HopMetadatum]
    timeout_s: float
    message: bytes
    schedulers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, method: _Optional[str] = ..., metadata: _Optional[_Iterable[_Union[HopMetadatum, _Mapping]]] = ..., timeout_s: _Optional[float] = ..., message: _Optional[bytes] = ..., schedulers: _Optional[_Iterable[str]] = ...) -> None: ...

class HopMetadatum(_message.Message):
    __slots__ = ("key", "text", "binary")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BINARY_FIELD_NUMBER: _ClassVar[int]
    key: str
    text: str
    binary: bytes
    def __init__(self, key: _Optional[str] = ..., text: _Optional[str] = ..., binary: _Optional[bytes] = ...) -> None: ...

class HopDown(_message.Message):
    __slots__ = ("call", "message", "end", "pong")
    CALL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    call: int
    message: bytes
    end: HopEnd
    pong: bool
    def __init__(self, call: _Optional[int] = ..., message: _Optional[bytes] = ..., end: _Optional[_Union[HopEnd, _Mapping]] = ..., pong: _Optional[bool] = ...) -> None: ...

class HopEnd(_message.Message):
    __slots__ = ("code", "details", "trailing", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    trailing: _containers.RepeatedCompositeFieldContainer[HopMetadatum]
    message: bytes
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., trailing: _Optional[_Iterable[_Union[HopMetadatum, _Mapping]]] = ..., message: _Optional[bytes] = ...) -> None: ...

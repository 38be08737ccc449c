from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("command", "name", "gpus", "priority", "ranks", "cwd", "env", "checkpoint_interval", "anywhere", "max_restarts", "min_gpus", "max_gpus", "tier")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    ANYWHERE_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MIN_GPUS_FIELD_NUMBER: _ClassVar[int]
    MAX_GPUS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    command: _containers.RepeatedScalarFieldContainer[str]
    name: str
    gpus: int
    priority: int
    ranks: int
    cwd: str
    env: _containers.ScalarMap[str, str]
    checkpoint_interval: float
    anywhere: bool
    max_restarts: int
    min_gpus: int
    max_gpus: int
    tier: str
    def __init__(self, command: _Optional[_Iterable[str]] = ..., name: _Optional[str] = ..., gpus: _Optional[int] = ..., priority: _Optional[int] = ..., ranks: _Optional[int] = ..., cwd: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., checkpoint_interval: _Optional[float] = ..., anywhere: _Optional[bool] = ..., max_restarts: _Optional[int] = ..., min_gpus: _Optional[int] = ..., max_gpus: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class ResizeRequest(_message.Message):
    __slots__ = ("id", "gpus")
    ID_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    id: int
    gpus: int
    def __init__(self, id: _Optional[int] = ..., gpus: _Optional[int] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "name", "user", "uid", "state", "reason", "pending_reason", "priority", "gpus", "ranks", "devices", "command", "submitted_at", "started_at", "ended_at", "exit_code", "signal", "cpu_seconds", "rss_bytes", "cwd", "attempt", "checkpoint_interval", "checkpoints", "checkpoint_bytes", "last_checkpoint", "starting", "node", "move", "max_restarts", "restarts_used", "min_gpus", "max_gpus", "splice_refusal", "tier")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PENDING_REASON_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    MOVE_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_USED_FIELD_NUMBER: _ClassVar[int]
    MIN_GPUS_FIELD_NUMBER: _ClassVar[int]
    MAX_GPUS_FIELD_NUMBER: _ClassVar[int]
    SPLICE_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    user: str
    uid: int
    state: str
    reason: str
    pending_reason: str
    priority: int
    gpus: int
    ranks: int
    devices: _containers.RepeatedScalarFieldContainer[int]
    command: _containers.RepeatedScalarFieldContainer[str]
    submitted_at: float
    started_at: float
    ended_at: float
    exit_code: int
    signal: int
    cpu_seconds: float
    rss_bytes: int
    cwd: str
    attempt: int
    checkpoint_interval: float
    checkpoints: int
    checkpoint_bytes: int
    last_checkpoint: CheckpointInfo
    starting: bool
    node: str
    move: MoveInfo
    max_restarts: int
    restarts_used: int
    min_gpus: int
    max_gpus: int
    splice_refusal: str
    tier: str
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., user: _Optional[str] = ..., uid: _Optional[int] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., pending_reason: _Optional[str] = ..., priority: _Optional[int] = ..., gpus: _Optional[int] = ..., ranks: _Optional[int] = ..., devices: _Optional[_Iterable[int]] = ..., command: _Optional[_Iterable[str]] = ..., submitted_at: _Optional[float] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., cpu_seconds: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., cwd: _Optional[str] = ..., attempt: _Optional[int] = ..., checkpoint_interval: _Optional[float] = ..., checkpoints: _Optional[int] = ..., checkpoint_bytes: _Optional[int] = ..., last_checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ..., starting: _Optional[bool] = ..., node: _Optional[str] = ..., move: _Optional[_Union[MoveInfo, _Mapping]] = ..., max_restarts: _Optional[int] = ..., restarts_used: _Optional[int] = ..., min_gpus: _Optional[int] = ..., max_gpus: _Optional[int] = ..., splice_refusal: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class MoveInfo(_message.Message):
    __slots__ = ("peer", "phase", "moved", "total", "sent")
    PEER_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    peer: str
    phase: str
    moved: int
    total: int
    sent: int
    def __init__(self, peer: _Optional[str] = ..., phase: _Optional[str] = ..., moved: _Optional[int] = ..., total: _Optional[int] = ..., sent: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("at", "from_state", "to_state", "reason")
    AT_FIELD_NUMBER: _ClassVar[int]
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    at: float
    from_state: str
    to_state: str
    reason: str
    def __init__(self, at: _Optional[float] = ..., from_state: _Optional[str] = ..., to_state: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class JobDetail(_message.Message):
    __slots__ = ("job", "env", "events", "log_path", "checkpoint_list")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOG_PATH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_LIST_FIELD_NUMBER: _ClassVar[int]
    job: Job
    env: _containers.ScalarMap[str, str]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    log_path: str
    checkpoint_list: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., env: _Optional[_Mapping[str, str]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., log_path: _Optional[str] = ..., checkpoint_list: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("seq", "created_at", "bytes", "complete", "pause_seconds", "complete_seconds", "stopped", "precopied_bytes", "paused_bytes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    PRECOPIED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAUSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    created_at: float
    bytes: int
    complete: bool
    pause_seconds: float
    complete_seconds: float
    stopped: bool
    precopied_bytes: int
    paused_bytes: int
    def __init__(self, seq: _Optional[int] = ..., created_at: _Optional[float] = ..., bytes: _Optional[int] = ..., complete: _Optional[bool] = ..., pause_seconds: _Optional[float] = ..., complete_seconds: _Optional[float] = ..., stopped: _Optional[bool] = ..., precopied_bytes: _Optional[int] = ..., paused_bytes: _Optional[int] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("job", "checkpoint", "pause_seconds")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job: Job
    checkpoint: CheckpointInfo
    pause_seconds: float
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ..., pause_seconds: _Optional[float] = ...) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    def __init__(self, id: _Optional[int] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("all", "user")
    ALL_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    all: bool
    user: str
    def __init__(self, all: _Optional[bool] = ..., user: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class JobUpdate(_message.Message):
    __slots__ = ("jobs", "is_change")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    IS_CHANGE_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    is_change: bool
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., is_change: _Optional[bool] = ...) -> None: ...

class LogsRequest(_message.Message):
    __slots__ = ("id", "follow", "tail", "rank", "offset")
    ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    id: int
    follow: bool
    tail: int
    rank: int
    offset: int
    def __init__(self, id: _Optional[int] = ..., follow: _Optional[bool] = ..., tail: _Optional[int] = ..., rank: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("data", "offset")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CancelResult(_message.Message):
    __slots__ = ("id", "ok", "error", "state", "code")
    ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    id: int
    ok: bool
    error: str
    state: str
    code: int
    def __init__(self, id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., state: _Optional[str] = ..., code: _Optional[int] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CancelResult]
    def __init__(self, results: _Optional[_Iterable[_Union[CancelResult, _Mapping]]] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Device(_message.Message):
    __slots__ = ("index", "kind", "name", "uuid", "memory_total", "memory_used", "utilization_percent", "jobs", "proxy", "sessions")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    PROXY_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    index: int
    kind: str
    name: str
    uuid: str
    memory_total: int
    memory_used: int
    utilization_percent: float
    jobs: _containers.RepeatedScalarFieldContainer[int]
    proxy: str
    sessions: _containers.RepeatedCompositeFieldContainer[DeviceSession]
    def __init__(self, index: _Optional[int] = ..., kind: _Optional[str] = ..., name: _Optional[str] = ..., uuid: _Optional[str] = ..., memory_total: _Optional[int] = ..., memory_used: _Optional[int] = ..., utilization_percent: _Optional[float] = ..., jobs: _Optional[_Iterable[int]] = ..., proxy: _Optional[str] = ..., sessions: _Optional[_Iterable[_Union[DeviceSession, _Mapping]]] = ...) -> None: ...

class DeviceSession(_message.Message):
    __slots__ = ("job", "rank", "bytes", "connected")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    job: int
    rank: int
    bytes: int
    connected: bool
    def __init__(self, job: _Optional[int] = ..., rank: _Optional[int] = ..., bytes: _Optional[int] = ..., connected: _Optional[bool] = ...) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    def __init__(self, devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ...) -> None: ...

class ClusterInitRequest(_message.Message):
    __slots__ = ("node_name", "cluster_name")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_NAME_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    cluster_name: str
    def __init__(self, node_name: _Optional[str] = ..., cluster_name: _Optional[str] = ...) -> None: ...

class ClusterTokenRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterJoinInfo(_message.Message):
    __slots__ = ("node_name", "token", "ca_fingerprint", "join_address", "token_expires_at", "node_number")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    JOIN_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    NODE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    token: str
    ca_fingerprint: str
    join_address: str
    token_expires_at: float
    node_number: int
    def __init__(self, node_name: _Optional[str] = ..., token: _Optional[str] = ..., ca_fingerprint: _Optional[str] = ..., join_address: _Optional[str] = ..., token_expires_at: _Optional[float] = ..., node_number: _Optional[int] = ...) -> None: ...

class ClusterJoinRequest(_message.Message):
    __slots__ = ("address", "token", "ca_fingerprint", "node_name")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    address: str
    token: str
    ca_fingerprint: str
    node_name: str
    def __init__(self, address: _Optional[str] = ..., token: _Optional[str] = ..., ca_fingerprint: _Optional[str] = ..., node_name: _Optional[str] = ...) -> None: ...

class ClusterJoinResponse(_message.Message):
    __slots__ = ("node_name", "node_number", "ca_node")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    CA_NODE_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    node_number: int
    ca_node: str
    def __init__(self, node_name: _Optional[str] = ..., node_number: _Optional[int] = ..., ca_node: _Optional[str] = ...) -> None: ...

class ListPeersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Peer(_message.Message):
    __slots__ = ("node", "address", "state", "devices", "free", "version", "last_contact", "draining", "error")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_CONTACT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    state: str
    devices: int
    free: int
    version: str
    last_contact: float
    draining: bool
    error: str
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., devices: _Optional[int] = ..., free: _Optional[int] = ..., version: _Optional[str] = ..., last_contact: _Optional[float] = ..., draining: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class ListPeersResponse(_message.Message):
    __slots__ = ("node", "node_number", "draining", "peers")
    NODE_FIELD_NUMBER: _ClassVar[int]
    NODE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    node: str
    node_number: int
    draining: bool
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    def __init__(self, node: _Optional[str] = ..., node_number: _Optional[int] = ..., draining: _Optional[bool] = ..., peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("id", "to")
    ID_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    id: int
    to: str
    def __init__(self, id: _Optional[int] = ..., to: _Optional[str] = ...) -> None: ...

class MoveProgress(_message.Message):
    __slots__ = ("id", "peer", "phase", "moved", "total", "done", "ok", "detail")
    ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    id: int
    peer: str
    phase: str
    moved: int
    total: int
    done: bool
    ok: bool
    detail: str
    def __init__(self, id: _Optional[int] = ..., peer: _Optional[str] = ..., phase: _Optional[str] = ..., moved: _Optional[int] = ..., total: _Optional[int] = ..., done: _Optional[bool] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class ListClusterJobsResponse(_message.Message):
    __slots__ = ("jobs", "unreachable")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., unreachable: _Optional[_Iterable[str]] = ...) -> None: ...

class DaemonInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DaemonInfo(_message.Message):
    __slots__ = ("version", "mode", "socket", "state_dir", "caller_uid", "caller_user", "caller_is_admin", "device_kind", "device_count", "nvml_status", "criu_unavailable_reason", "criu_path", "criu_version", "started_at", "pid_namespaces", "restore_guard_problem")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    STATE_DIR_FIELD_NUMBER: _ClassVar[int]
    CALLER_UID_FIELD_NUMBER: _ClassVar[int]
    CALLER_USER_FIELD_NUMBER: _ClassVar[int]
    CALLER_IS_ADMIN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    NVML_STATUS_FIELD_NUMBER: _ClassVar[int]
    CRIU_UNAVAILABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    CRIU_PATH_FIELD_NUMBER: _ClassVar[int]
    CRIU_VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    RESTORE_GUARD_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    version: str
    mode: str
    socket: str
    state_dir: str
    caller_uid: int
    caller_user: str
    caller_is_admin: bool
    device_kind: str
    device_count: int
    nvml_status: str
    criu_unavailable_reason: str
    criu_path: str
    criu_version: str
    started_at: float
    pid_namespaces: bool
    restore_guard_problem: str
    def __init__(self, version: _Optional[str] = ..., mode: _Optional[str] = ..., socket: _Optional[str] = ..., state_dir: _Optional[str] = ..., caller_uid: _Optional[int] = ..., caller_user: _Optional[str] = ..., caller_is_admin: _Optional[bool] = ..., device_kind: _Optional[str] = ..., device_count: _Optional[int] = ..., nvml_status: _Optional[str] = ..., criu_unavailable_reason: _Optional[str] = ..., criu_path: _Optional[str] = ..., criu_version: _Optional[str] = ..., started_at: _Optional[float] = ..., pid_namespaces: _Optional[bool] = ..., restore_guard_problem: _Optional[str] = ...) -> None: ...

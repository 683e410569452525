"""The estimator's gRPC API (estimator.proto and the code generated from it)."""

# The longest a hold for a defragmentation may last (HoldRequest.seconds).
MAX_HOLD_SECONDS = 3600.0

# How long room an estimator reserved for a pod (EstimateRequest.reserve) is held when
# neither its binding there nor a release arrives (the scheduler chose another node and
# the release was lost, or the binding failed).
RESERVATION_SECONDS = 30.0

# The estimator's connections are pinged this often when idle, and dropped when a ping is
# not answered within KEEPALIVE_TIMEOUT_MS: a connection a network dropped silently (no
# reset: a node gone, a NAT's table flushed) failed every call by its deadline until the
# kernel gave up on it, a quarter of an hour, and the cluster was refused meanwhile.
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000


def client_keepalive_options() -> tuple[tuple[str, int], ...]:
    """Pings on an idle connection, calls open or not; one unanswered ends it (gRPC
    times it out by ``ping_timeout_ms``, a minute unless set, not by the keepalive's)."""
    return (
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    )


def server_keepalive_options() -> tuple[tuple[str, int], ...]:
    """What the server lets a client do: pings as often as ``client_keepalive_options``
    sends them, calls or not (gRPC's server otherwise takes pings more often than every
    5 minutes without data for abuse, and hangs up with GOAWAY too_many_pings)."""
    return (
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    )

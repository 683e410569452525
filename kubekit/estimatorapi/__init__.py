"""The estimator's gRPC API (estimator.proto and the code generated from it)."""

# The longest a hold for a defragmentation may last (HoldRequest.seconds).
MAX_HOLD_SECONDS = 3600.0

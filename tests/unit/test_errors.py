import grpc

from llmesh import errors


def test_invalid_argument_carries_every_field_violation() -> None:
    err = errors.InvalidArgument([("sampling.top_p", "must be in [0, 1]"), ("prompt", "must not be empty")])
    status = errors.status_details(err.trailing_metadata())
    assert status is not None and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    bad = errors.unpack_details(status)["bad_request"]
    assert [(v.field, v.description) for v in bad.field_violations] == [  # type: ignore[attr-defined]
        ("sampling.top_p", "must be in [0, 1]"),
        ("prompt", "must not be empty"),
    ]


def test_resource_exhausted_carries_retry_info_and_pushback() -> None:
    err = errors.ResourceExhausted("busy", retry_after=1.25, reason="QUEUE_FULL")
    trailing = err.trailing_metadata()
    assert (errors.RETRY_PUSHBACK_KEY, "1250") in trailing
    details = errors.unpack_details(errors.status_details(trailing))
    delay = details["retry_info"].retry_delay  # type: ignore[attr-defined]
    assert (delay.seconds, delay.nanos) == (1, 250_000_000)
    assert details["error_info"].reason == "QUEUE_FULL"  # type: ignore[attr-defined]


def test_peer_error_relays_the_original_code_and_details() -> None:
    original = errors.ResourceExhausted("queue full", retry_after=0.5)
    status_bin = dict(original.trailing_metadata())[errors.STATUS_DETAILS_KEY]
    assert isinstance(status_bin, bytes)
    relayed = errors.PeerError("inference", grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", status_bin)
    assert relayed.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = errors.unpack_details(errors.status_details(relayed.trailing_metadata()))
    assert "retry_info" in details
    assert relayed.message == "inference: queue full"


def test_a_flood_of_violations_stays_small_enough_to_deliver() -> None:
    err = errors.InvalidArgument([(f"documents[{i}].text", "must not be empty" * 50) for i in range(50_000)])
    assert len(err.violations) == errors.MAX_VIOLATIONS + 1
    assert err.violations[-1][1] == "and 49990 more problems"
    assert len(err.message) <= errors.MAX_MESSAGE_CHARS
    size = sum(len(v) for _, v in err.trailing_metadata())
    assert size < 4096

import grpc
import pytest

from kvfs import errors


@pytest.mark.parametrize("cls", [errors.InvalidArgument, errors.NotFound, errors.AlreadyExists,
                                 errors.OutOfRange, errors.DataLoss, errors.ResourceExhausted,
                                 errors.Unavailable, errors.DeadlineExceeded, errors.Internal])
def test_codes_map_to_types_and_back(cls):
    err = errors.from_code(cls.code, "what went wrong")
    assert type(err) is cls and err.message == "what went wrong"
    assert type(errors.from_code(cls.code.value[0], "x")) is cls  # per-range results carry numbers


def test_unmapped_code_keeps_its_code():
    err = errors.from_code(grpc.StatusCode.ABORTED, "aborted")
    assert err.code == grpc.StatusCode.ABORTED and isinstance(err, errors.KvfsError)

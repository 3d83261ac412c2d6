import pytest

import cairn
from cairn import _ext
from cairn.errors import exception_for_code


def test_not_found_is_file_not_found_error():
    assert issubclass(exception_for_code("NotFound"), FileNotFoundError)
    assert issubclass(exception_for_code("NotFound"), cairn.Error)


def test_invalid_key_raises_value_error_from_cpp():
    with pytest.raises(ValueError, match="'..'"):
        _ext.validate_key("a/../b")
    with pytest.raises(cairn.Error):
        _ext.validate_key("/etc/passwd")


# ---- retryable vs permanent -----------------------------------------------------

def test_transient_codes_map_to_transient_errors():
    unavailable = exception_for_code("Unavailable")
    assert issubclass(unavailable, cairn.TransientError)
    assert issubclass(unavailable, cairn.StorageError)  # existing except clauses keep working
    assert issubclass(unavailable, OSError) and issubclass(unavailable, cairn.Error)
    deadline = exception_for_code("DeadlineExceeded")
    assert issubclass(deadline, cairn.TransientError) and issubclass(deadline, TimeoutError)


@pytest.mark.parametrize("code", ["IOError", "DataLoss", "NotFound", "InvalidArgument",
                                  "PermissionDenied", "ResourceExhausted", "Internal"])
def test_permanent_codes_are_not_transient(code):
    assert not issubclass(exception_for_code(code), cairn.TransientError)


def _injected(tmp_path, err):
    import errno

    inj = _ext.FaultInjector()
    inj.add_rule("write", errno=getattr(errno, err))
    with pytest.raises(cairn.Error) as ei:
        inj.wrap(_ext.open_storage(str(tmp_path))).write_file("data/r0.bin", b"x")
    return ei.value


def test_an_unavailable_storage_raises_a_transient_storage_error(tmp_path):
    e = _injected(tmp_path, "EAGAIN")
    assert isinstance(e, cairn.TransientError) and isinstance(e, cairn.StorageError)
    assert e.code == "Unavailable"


def test_an_io_error_is_a_permanent_storage_error(tmp_path):
    e = _injected(tmp_path, "EIO")
    assert isinstance(e, cairn.StorageError) and not isinstance(e, cairn.TransientError)
    assert e.code == "IOError"

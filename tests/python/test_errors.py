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

"""The package ships its type information (PEP 561); ``make typecheck`` runs mypy itself."""

from importlib import resources


def test_py_typed_marker_is_in_the_package() -> None:
    marker = resources.files("rcdl") / "py.typed"
    assert marker.is_file()
    assert marker.read_text() == ""  # a marker: no partial-stub declaration

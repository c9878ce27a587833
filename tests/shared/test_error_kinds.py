"""One mapping from an exception to its error kind (``shared.errors.ERROR_KINDS``): every error
class of the project is in exactly one row, the CLI prints it under that row's kind and the
controller answers it with that row's wire kind (``Error.kind`` on ``responses``)."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest

import shared.catalog
import shared.errors
from shared.controller_state import CommandRejected, error_kind
from shared.errors import (
    ERROR_KINDS,
    KIND_OF_WIRE,
    ShardNotFoundError,
    ShardsinkError,
    kind_of,
)

#: The modules that define the project's error classes (``shared.catalog`` adds its own).
ERROR_MODULES = (shared.errors, shared.catalog)


def error_classes(module: types.ModuleType) -> Iterator[type[ShardsinkError]]:
    """Every error class defined in ``module``: each subclass of the layers' root."""
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, ShardsinkError) and value.__module__ == module.__name__:
            yield value


def rows_naming(name: str) -> list[str]:
    """The kinds of :data:`ERROR_KINDS` whose row lists the class ``name``."""
    return [kind for kind, row in ERROR_KINDS.items() if name in row.classes]


def classes_without_one_kind(module: types.ModuleType) -> dict[str, list[str]]:
    """The error classes of ``module`` in no row or in several: name -> the rows naming it."""
    return {cls.__name__: rows for cls in error_classes(module) if len(rows := rows_naming(cls.__name__)) != 1}


ALL_CLASSES = [cls for m in ERROR_MODULES for cls in error_classes(m)]


def test_the_error_modules_define_the_classes_the_walk_finds() -> None:
    names = {cls.__name__ for cls in ALL_CLASSES}
    assert {"ShardsinkError", "StorageError", "CodecError", "KafkaAdapterError", "ShardNotFoundError",
            "CatalogError", "FencedError", "UnknownCollectionError"} <= names
    assert len(names) == len(ALL_CLASSES) >= 40


@pytest.mark.parametrize("module", ERROR_MODULES, ids=lambda m: m.__name__)
def test_every_error_class_has_exactly_one_kind(module: types.ModuleType) -> None:
    assert classes_without_one_kind(module) == {}


def test_a_class_added_without_a_kind_is_found() -> None:
    module = types.ModuleType("shared.errors_extended")

    class BrandNewError(ShardNotFoundError):
        pass

    BrandNewError.__module__ = module.__name__
    module.BrandNewError = BrandNewError  # type: ignore[attr-defined]
    module.ShardNotFoundError = ShardNotFoundError  # type: ignore[attr-defined]  # imported, not defined here
    assert classes_without_one_kind(module) == {"BrandNewError": []}


def test_every_class_a_row_names_exists() -> None:
    known = {cls.__name__ for cls in ALL_CLASSES} | {"ValueError"}
    named = [name for row in ERROR_KINDS.values() for name in row.classes]
    assert sorted(set(named) - known) == []
    assert len(named) == len(set(named)), "a class named in two rows"


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_an_error_is_reported_under_its_rows_kind_by_the_cli_and_the_controller(cls: type[ShardsinkError]) -> None:
    (kind,) = rows_naming(cls.__name__)
    e = cls(f"expected a {cls.__name__}, found one")
    assert kind_of(e) == kind
    assert error_kind(e) == ERROR_KINDS[kind].wire != ""


def test_a_missing_shard_is_identifier_missing_on_the_wire_and_unknown_id_in_the_cli() -> None:
    e = ShardNotFoundError("expected a shard 'c1', found none", shard_id="c1")
    assert error_kind(e) == "IdentifierMissing"
    assert kind_of(e) == "UnknownIdError"


@pytest.mark.parametrize(("e", "wire"), [
    (shared.catalog.UnknownCollectionError("x"), "IdentifierMissing"),
    (shared.errors.ShardDroppedError("x"), "IdentifierMissing"),
    (shared.catalog.IdReuseError("x"), "IdentifierReused"),
    (shared.errors.ShardExistsError("x"), "IdentifierReused"),
    (shared.errors.SinceViolationError("x"), "ReadBeforeSince"),
    (shared.errors.NotReadableYetError("x"), "NotReadableYet"),
    (shared.errors.UpperMismatchError("x"), "UpperMismatch"),
    (shared.errors.IncompatibleSchemaError("x"), "IncompatibleSchema"),
    (shared.errors.SchemaMismatchError("x"), "SchemaError"),
    (shared.errors.DecodeError("x"), "DecodeError"),
    (shared.errors.EncodeError("x"), "InvalidUsage"),
    (shared.catalog.CatalogNotFoundError("x"), "InvalidUsage"),
    (ValueError("x"), "InvalidUsage"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "InvalidUsage"),
    (shared.errors.ObjectStoreError("x"), "Internal"),
    (KeyError("x"), "Internal"),
    (CommandRejected("UpdateBeyondUpper", "x"), "UpdateBeyondUpper"),
])
def test_the_controller_answers_each_failure_with_its_wire_kind(e: BaseException, wire: str) -> None:
    assert error_kind(e) == wire


def test_a_controller_answer_reads_back_as_the_first_kind_of_its_wire_kind() -> None:
    for wire, kind in KIND_OF_WIRE.items():
        assert ERROR_KINDS[kind].wire == wire
        assert kind == next(k for k, row in ERROR_KINDS.items() if row.wire == wire)
    assert {w: KIND_OF_WIRE[w] for w in ("IdentifierMissing", "InvalidUsage", "Internal")} == {
        "IdentifierMissing": "UnknownIdError", "InvalidUsage": "InvalidUsageError", "Internal": "InternalError"}
    answer = shared.errors.CommandError("expected a collection 'c1', found none", kind="IdentifierMissing")
    assert kind_of(answer) == "UnknownIdError" and error_kind(answer) == "IdentifierMissing"

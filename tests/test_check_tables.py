"""Each check reads only the run tables it names in ``analyzers.checks.TABLES`` (and ``steps``, which every frame is
built over): run on a copy of the run whose other tables raise when read, each check gives the findings and coverage
it gives on the run itself. A check that reads a table it did not name fails here (the last test shows the guard
catching one)."""

from __future__ import annotations

import copy

import msgspec
import pytest
from analyzer_fixtures import build, gpu_samples, with_records

from analyzers.builder import build_frame, signals_of
from analyzers.checks import CHECKS, TABLES
from analyzers.loader import TABLE_TYPES, RunData

ALL_TABLES = frozenset(TABLE_TYPES) | {"nccl_tests", "actions"}


class UndeclaredTable(AssertionError):
    pass


def guarded(data: RunData, check: str, allowed: frozenset[str]) -> RunData:
    """A shallow copy of ``data`` whose tables outside ``allowed`` (and ``steps``) raise when read, by the check or by
    RunData's own methods."""
    def barred(name: str) -> property:
        def get(self):
            raise UndeclaredTable(f"{check} read the {name} table, which analyzers.checks.TABLES does not name for it")

        def put(self, value):
            self.__dict__[name] = value
        return property(get, put)

    g = copy.copy(data)
    g.__class__ = type("Guarded", (RunData,), {n: barred(n) for n in ALL_TABLES - allowed - {"steps"}})
    return g


def _runs() -> list[RunData]:
    slow = build(world=8, steps=40, compute_factor=lambda r, s: 1.2 if (r == 3 and s >= 12) else 1.0)
    plain = build(world=4, steps=30, seed=2)
    with_gpu = with_records(plain, gpu_samples(plain))
    return [slow, with_gpu,
            build(world=8, steps=60, pp=2, noise=0.03, compute_factor=lambda r, s: 1.3 if (r == 5 and 20 <= s < 45) else 1.0),
            build(world=8, steps=45, device_time=True, host_noise=0.2, seed=1,
                  compute_factor=lambda r, s: 1.2 if (r == 6 and s >= 25) else 1.0),
            build(world=4, steps=40, fp16=True, overflow=lambda r, s: s > 20, stop={2: 30})]


def _run_check(data: RunData, name: str, frame_data: RunData) -> tuple[bytes, object]:
    frame = build_frame(frame_data)
    frame.__dict__["signals"] = signals_of(data)  # the whole run's, as a round works it out
    got = CHECKS[name].analyze(frame, None)
    return msgspec.json.encode(got), CHECKS[name].coverage(frame, None)


def test_every_check_names_its_tables():
    assert set(TABLES) == set(CHECKS)
    for name, tables in TABLES.items():
        assert tables <= ALL_TABLES, name


@pytest.mark.parametrize("run", range(5))
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_a_check_reads_only_the_tables_it_names(run, name):
    data = _runs()[run]
    want = _run_check(data, name, data)
    assert _run_check(data, name, guarded(data, name, TABLES[name])) == want


def test_the_guard_catches_a_check_reading_a_table_it_did_not_name():
    data = _runs()[0]
    assert not data.collectives.empty
    with pytest.raises(UndeclaredTable, match="stragglers read the collectives table"):
        _run_check(data, "stragglers", guarded(data, "stragglers", frozenset()))
    with pytest.raises(UndeclaredTable, match="gpu"):
        _run_check(_runs()[1], "mfu", guarded(_runs()[1], "mfu", frozenset()))

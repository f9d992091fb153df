"""KVGUARD_FAULTS parsing: off by default, typed switches, clear errors, loud logging."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from kvguard.workers.faults import (
    ENV_VAR,
    NO_FAULTS,
    Faults,
    FaultSpecError,
    faults_from_env,
    log_enabled_faults,
    parse_faults,
)


def test_default_is_all_off() -> None:
    assert faults_from_env({}) == NO_FAULTS
    assert parse_faults("") == NO_FAULTS
    assert NO_FAULTS.enabled() == []
    assert not NO_FAULTS.any_enabled


def test_every_switch_parses_to_a_typed_field() -> None:
    faults = parse_faults(
        "corrupt_chunk=0.25, drop_chunk=1,delay_chunk_ms=30,delay_prefill_ms=40,delay_step_ms=3,crash_prefill_after_chunks=2,"
        "no_abort_propagation,no_checksum,no_tags,unsafe_reject_path,ignore_manifest,fail_proxied_requests,seed=9"
    )
    assert faults == Faults(
        corrupt_chunk=0.25, drop_chunk=1.0, delay_chunk_ms=30, delay_prefill_ms=40, delay_step_ms=3, crash_prefill_after_chunks=2,
        no_abort_propagation=True, no_checksum=True, no_tags=True, unsafe_reject_path=True,
        ignore_manifest=True, fail_proxied_requests=True, seed=9,
    )
    assert faults.any_enabled
    assert parse_faults(faults.to_spec()) == faults


def test_seed_alone_enables_nothing() -> None:
    assert not parse_faults("seed=3").any_enabled


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("corupt_chunk=0.1", "unknown fault switch 'corupt_chunk'"),
        ("corrupt_chunk=1.5", "corrupt_chunk"),
        ("drop_chunk=-0.1", "drop_chunk"),
        ("delay_chunk_ms=abc", "delay_chunk_ms"),
        ("corrupt_chunk", "needs a value"),
        ("no_tags=1", "takes no value"),
        ("no_tags,no_tags", "given twice"),
        ("crash_prefill_after_chunks=-1", "crash_prefill_after_chunks"),
    ],
)
def test_bad_specs_name_the_switch(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=message) as info:
        parse_faults(spec)
    assert ENV_VAR in str(info.value)


def test_env_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "no_checksum")
    assert faults_from_env() == Faults(no_checksum=True)


def test_enabled_faults_are_logged_as_warnings(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvguard.faults"):
        log_enabled_faults(parse_faults("drop_chunk=0.5,ignore_manifest"))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("drop_chunk=0.5" in m for m in warned)
    assert any("ignore_manifest" in m for m in warned)


def test_rng_is_seeded_and_deterministic() -> None:
    a, b = Faults(seed=4).rng(), Faults(seed=4).rng()
    assert [a.random() for _ in range(5)] == [b.random() for _ in range(5)]
    assert Faults(seed=5).rng().random() != Faults(seed=4).rng().random()


def test_faults_are_immutable() -> None:
    with pytest.raises(ValidationError):
        NO_FAULTS.no_tags = True  # type: ignore[misc]

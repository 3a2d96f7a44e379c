"""Structured logs: every line a JSON object with time, level, event and fields; stdlib logging (what
grpc and asyncio use) rendered the same way; levels filter both."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.agent.logs import configure_logging, get_logger


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """configure_logging changes process-wide state; later tests must not inherit it."""
    root = logging.getLogger()
    handlers, level, config = root.handlers[:], root.level, structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    parsed = [json.loads(line) for line in out.getvalue().splitlines()]
    assert all(isinstance(p, dict) for p in parsed)
    return parsed


def configured(level: str = "info") -> io.StringIO:
    out = io.StringIO()
    configure_logging(level, "json", stream=out)
    return out


def test_events_are_json_lines_with_time_level_event_and_fields() -> None:
    out = configured()
    log = get_logger(node="gpu-17")
    log.info("generation_published", generation=3, fingerprint="ab12")
    log.bind(plan_id="p-1").warning("plan_rolled_back", reason="cpuset write failed")
    first, second = lines(out)
    stamp = datetime.fromisoformat(first.pop("timestamp"))
    assert stamp.utcoffset() is not None and stamp.utcoffset() == UTC.utcoffset(None)
    assert abs((datetime.now(UTC) - stamp).total_seconds()) < 60
    assert first == {"level": "info", "event": "generation_published", "node": "gpu-17", "generation": 3,
                     "fingerprint": "ab12"}
    second.pop("timestamp")
    assert second == {"level": "warning", "event": "plan_rolled_back", "node": "gpu-17", "plan_id": "p-1",
                      "reason": "cpuset write failed"}
    # Time, level and event lead each line, for people reading the journal.
    assert list(json.loads(out.getvalue().splitlines()[0]))[:3] == ["timestamp", "level", "event"]


def test_level_filters_the_agents_events_and_stdlib_records() -> None:
    out = configured("warning")
    log = get_logger()
    log.debug("hidden_debug")
    log.info("hidden_info")
    logging.getLogger("grpc._cython.cygrpc").info("hidden foreign info")
    log.warning("link_lost", peer="10.0.0.1:7443")
    log.error("plan_failed")
    logging.getLogger("asyncio").error("shown foreign error")
    assert [(e["level"], e["event"]) for e in lines(out)] == [
        ("warning", "link_lost"), ("error", "plan_failed"), ("error", "shown foreign error")]


def test_stdlib_logging_goes_through_the_same_renderer() -> None:
    out = configured()
    logging.getLogger("grpc._cython.cygrpc").warning("Unexpected %s raised by %s", "KeyError", "/x.Y/Z",
                                                     extra={"peer": "unix:"})
    (event,) = lines(out)
    event.pop("timestamp")
    assert event == {"level": "warning", "event": "Unexpected KeyError raised by /x.Y/Z",
                     "logger": "grpc._cython.cygrpc", "peer": "unix:"}


def test_exceptions_become_one_string_field_on_one_line() -> None:
    out = configured()
    try:
        raise RuntimeError("cgroup vanished")
    except RuntimeError:
        get_logger().exception("apply_crashed", plan_id="p-9")
        logging.getLogger("grpc").error("handler died", exc_info=True)
    ours, foreign = lines(out)
    assert len(out.getvalue().splitlines()) == 2
    for event in (ours, foreign):
        assert event["level"] == "error"
        assert event["exception"].startswith("Traceback (most recent call last):")
        assert event["exception"].endswith("RuntimeError: cgroup vanished")
    assert ours["plan_id"] == "p-9"


def test_values_json_cannot_encode_still_give_a_json_line() -> None:
    out = configured()
    get_logger().info("odd_fields", path=Path("/sys/devices"), raw=b"\xff\x00", obj=object(), items={1, 2})
    (event,) = lines(out)
    assert event["path"] == "/sys/devices"
    assert (event["raw"], event["items"]) == ("b'\\xff\\x00'", "{1, 2}")
    assert event["obj"].startswith("<object object at")


def test_reconfiguring_reaches_existing_loggers_and_replaces_only_our_handler() -> None:
    foreign = logging.NullHandler()
    logging.getLogger().addHandler(foreign)
    log = get_logger(component="link")
    first = configured("info")
    log.debug("not_yet")
    second = configured("debug")
    log.debug("now_visible")
    assert first.getvalue() == ""
    assert [e["event"] for e in lines(second)] == ["now_visible"]
    assert foreign in logging.getLogger().handlers
    ours = [h for h in logging.getLogger().handlers if type(h).__name__ == "_MemtopoHandler"]
    assert len(ours) == 1


def test_default_stream_is_stdout_at_call_time(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info")
    get_logger().info("to_stdout", n=1)
    captured = capsys.readouterr()
    assert json.loads(captured.out)["event"] == "to_stdout"
    assert captured.err == ""


def test_console_format_is_for_people() -> None:
    out = io.StringIO()
    configure_logging("info", "console", stream=out)
    get_logger(node="n1").info("generation_published", generation=4)
    line = out.getvalue().strip()
    assert "generation_published" in line and "generation=4" in line and "node=n1" in line
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)


@pytest.mark.parametrize(("level", "fmt", "match"), [
    ("verbose", "json", "log level 'verbose' is not one of debug, info, warning, error"),
    ("INFO", "json", "log level 'INFO'"),
    ("info", "logfmt", "log format 'logfmt' is not one of json, console"),
])
def test_unknown_level_or_format_is_a_clear_error(level: str, fmt: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        configure_logging(level, fmt, stream=io.StringIO())


def test_threads_never_interleave_lines() -> None:
    out = configured()

    def worker(n: int) -> None:
        log = get_logger(worker=n)
        for i in range(200):
            log.info("tick", i=i, payload="x" * 200)
            logging.getLogger("grpc").info("foreign %d", i)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = lines(out)
    assert len(events) == 6 * 200 * 2
    assert sum(1 for e in events if e["event"] == "tick") == 1200


_RESERVED = {"event", "level", "timestamp", "logger", "exc_info", "stack_info", "exception"}
_json_values = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**53), max_value=2**53),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=50))


@settings(max_examples=80, deadline=None)
@given(st.text(min_size=1, max_size=40),
       st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: k not in _RESERVED and not k.startswith("_")),
                       _json_values, max_size=6))
def test_any_event_and_fields_give_exactly_one_line_that_round_trips(event: str, fields: dict[str, Any]) -> None:
    """Newlines, quotes and unicode in names or values never split or corrupt a line."""
    out = configured()
    get_logger().info(event, **fields)
    (parsed,) = lines(out)
    parsed.pop("timestamp")
    assert parsed == {"level": "info", "event": event, **fields}


def test_throttle_allows_one_event_per_key_per_interval_and_counts_the_rest() -> None:
    from memtopo.throttle import Throttle

    now = [0.0]
    t = Throttle(interval=60.0, max_keys=2, clock=lambda: now[0])
    assert t.allow("a") == 0
    assert [t.allow("a") for _ in range(5)] == [None] * 5
    assert t.allow("b") == 0  # keys are independent
    now[0] = 61.0
    assert t.allow("a") == 5  # the next event carries what was held back
    assert t.allow("a") is None
    assert t.allow("c") == 0  # a third key evicts the oldest ("b")
    assert t.allow("b") == 0

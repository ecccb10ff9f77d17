"""kvfs.logs: a record with a traceback, quotes and newlines is still one line of
JSON holding each of them (JsonFormatter); a server's logging never waits on its
stderr (setup_logging)."""

from __future__ import annotations

import datetime
import io
import json
import logging
import select
import subprocess
import sys

import pytest

from kvfs.logs import JsonFormatter


def test_a_record_with_a_traceback_is_one_json_line():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("kvfs.test_logs")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise ValueError('slot "7"\nbroken')
        except ValueError:
            logger.error("write of %s failed", 'chunk "a"\nb')
            logger.exception("scrub failed")
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first == {"time": first["time"], "level": "ERROR", "logger": "kvfs.test_logs",
                     "message": 'write of chunk "a"\nb failed'}
    assert datetime.datetime.fromisoformat(first["time"]).tzinfo == datetime.timezone.utc
    assert second["message"] == "scrub failed"
    assert second["exc_info"].startswith("Traceback") and second["exc_info"].endswith('ValueError: slot "7"\nbroken')


# A server process logs through setup_logging, then says it is done on another pipe; nobody
# reads its stderr until then. Each line is 1 KiB, together 20 times a pipe's buffer.
LOGGING_CHILD = r"""
import logging, sys
from kvfs import logs
if len(sys.argv) > 2:
    logs.MAX_QUEUED_LINES = int(sys.argv[2])
logs.setup_logging("INFO", sys.argv[1])
log = logging.getLogger("kvfs.child")
for i in range(1280):
    log.info("line %05d %s", i, "x" * 1000)
print("logged", flush=True)
"""


def log_into_an_undrained_pipe(tmp_path, *args: str) -> list[str]:
    """Runs LOGGING_CHILD; stderr is read only once it said it logged everything."""
    child = subprocess.Popen([sys.executable, "-c", LOGGING_CHILD, *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        # stdout's line comes while stderr is not being read: with logging on the caller's
        # thread, the first 64 KiB would have filled the pipe and blocked the child there
        ready, _, _ = select.select([child.stdout], [], [], 30)
        assert ready, "the child was held logging into a full pipe"
        assert child.stdout.readline() == b"logged\n"
        err = child.stderr.read()
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
        child.wait()
    return err.decode().splitlines()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_logging_never_waits_for_stderr_and_every_line_arrives_in_order(fmt, tmp_path):
    """A caller returns from log.info at once though stderr is a pipe nobody drains
    (a log shipper that fell behind); the lines follow, all of them, in order, once
    it is read, and the process exits only after writing the last one."""
    lines = log_into_an_undrained_pipe(tmp_path, fmt)
    assert len(lines) == 1280
    messages = [json.loads(line)["message"] if fmt == "json" else line.split(": ", 1)[1] for line in lines]
    assert messages == [f"line {i:05d} {'x' * 1000}" for i in range(1280)]


def test_past_the_queue_bound_lines_are_dropped_and_counted(tmp_path):
    """With 100 lines allowed to wait and stderr not drained, the child is still not
    held and its memory does not grow with what it logs: lines that do not fit are
    dropped, and a line in their place counts them, exactly the gap they leave."""
    expected, dropped_lines = 0, 0
    for line in log_into_an_undrained_pipe(tmp_path, "text", "100"):
        message = line.split(": ", 1)[1]
        if message.endswith(" log lines dropped: stderr did not keep up"):
            expected += int(message.split()[0])
            dropped_lines += 1
        else:
            assert message == f"line {expected:05d} {'x' * 1000}"
            expected += 1
    assert expected == 1280 and dropped_lines >= 1

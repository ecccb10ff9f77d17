"""kvfs.logs.JsonFormatter: a record with a traceback, quotes and newlines is still
one line of JSON holding each of them."""

from __future__ import annotations

import datetime
import io
import json
import logging

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

"""How a server's log lines look: text for people, or one JSON object per line for
log shippers (Loki, Elasticsearch, Cloud Logging), which then need no parsing rules."""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import logging.handlers
import queue
import sys
from typing import Any

from kvfs.config import option

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON: time (UTC, ISO 8601), level, logger, message,
    and exc_info (the formatted traceback) when the record carries one. json.dumps
    escapes the message, so a newline or quote in it cannot split or break a line."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False)


def log_format_option() -> Any:
    """The `log_format` setting every server has."""
    return option("text", "log lines as text, or json: one object per line (time, level, logger, message, "
                  "exc_info) for log shippers", FORMATS)


# Lines waiting for the writer thread at most; past that, lines are dropped and counted, and
# the next line that gets in is preceded by one that says how many went (a stderr nobody
# reads must not grow the server's memory without bound, whoever makes it log)
MAX_QUEUED_LINES = 10_000
EXIT_WAIT = 5.0  # seconds the exit waits for the queued lines to be written, at most


class _QueuedLines(logging.handlers.QueueHandler):
    """A QueueHandler on a bounded queue that drops and counts what does not fit."""

    def __init__(self, lines: queue.Queue):
        super().__init__(lines)
        self.dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:  # called under the handler's lock
        try:
            if self.dropped:
                self.queue.put_nowait(self._dropped_line())
                self.dropped = 0
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def _dropped_line(self) -> logging.LogRecord:
        return self.prepare(logging.LogRecord(__name__, logging.WARNING, __file__, 0,
                                              "%d log lines dropped: stderr did not keep up", (self.dropped,), None))

    def say_dropped(self) -> None:
        """At exit: a line that says how many lines went, if any did (waiting
        EXIT_WAIT at most for room)."""
        with self.lock:
            if self.dropped:
                self.queue.put(self._dropped_line(), timeout=EXIT_WAIT)
                self.dropped = 0


class _Writer(logging.handlers.QueueListener):
    """A QueueListener whose stop waits EXIT_WAIT at most for what is queued to be
    written: stderr may never drain."""

    def stop(self) -> None:
        try:
            self.queue.put(self._sentinel, timeout=EXIT_WAIT)
        except queue.Full:
            return
        self._thread.join(EXIT_WAIT)


def _at_exit(handler: _QueuedLines, writer: _Writer) -> None:
    try:
        handler.say_dropped()
    except queue.Full:
        return
    writer.stop()


def setup_logging(level: str, fmt: str) -> None:
    """Sends the process's log lines to stderr at `level`, as `fmt` (one of FORMATS).
    A line is formatted where it is logged and written by a thread of its own
    (a logging.handlers.QueueListener), which drains the queue at exit: an event loop
    that logs never waits on stderr's write, which blocks while the disk under a log
    file is busy (a filling metaserver's loop was seen held 93 ms in a write to a
    file of its own, a trace added to measure it) or while whoever reads a pipe
    falls behind. At most MAX_QUEUED_LINES wait; the rest are dropped, and counted
    in the log."""
    lines: queue.Queue = queue.Queue(MAX_QUEUED_LINES)
    handler = _QueuedLines(lines)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    out = logging.StreamHandler(sys.stderr)
    out.setFormatter(logging.Formatter("%(message)s"))  # the line as formatted by `handler`
    writer = _Writer(lines, out)
    writer.start()
    atexit.register(_at_exit, handler, writer)
    logging.basicConfig(level=level, handlers=[handler])
    logging.captureWarnings(True)  # Python's warnings too, so every line of a JSON log is JSON

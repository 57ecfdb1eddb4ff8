"""Log lines for a person and for machines: short colored lines on a terminal (a real
pseudo-terminal here), JSON lines on a pipe or with LLMESH_LOG_FORMAT=json, and the
supervisor rendering its services' JSON lines the same way."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys

import pytest

from llmesh.supervisor import LogEcho
from llmesh.telemetry import render_console
from llmesh.testing import REPO_ROOT

ANSI = re.compile(r"\x1b\[[0-9;]*m")
CLOCK = r"\d\d:\d\d:\d\d\.\d{3}"

SNIPPET = """
import logging, sys
from llmesh import telemetry
telemetry.setup_logging("gateway", "INFO", sys.argv[1])
log = logging.getLogger("llmesh.test")
log.warning("circuit breaker open", extra={"fields": {"event": "breaker_transition", "peer": "cache",
                                                      "reason": "failure rate 0.6"}})
log.info("listening", extra={"fields": {"event": "listening", "port": 50051}})
from tqdm import tqdm
for _ in tqdm(range(3), desc="Loading weights"):
    pass
"""


def run_in_pty(args: list[str], env: dict[str, str]) -> str:
    """Runs a command with stdout and stderr on a new pseudo-terminal; returns what it wrote."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower, env=env, cwd=REPO_ROOT)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(60) == 0, out.decode(errors="replace")
    return out.decode().replace("\r\n", "\n")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TQDM_DISABLE", "LLMESH_LOG_FORMAT")}
    return {**env, **extra}


def test_terminal_gets_short_colored_lines() -> None:
    out = run_in_pty([sys.executable, "-c", SNIPPET, "auto"], child_env())
    assert "\x1b[33mWARNING" in out and "\x1b[32mINFO" in out, repr(out)
    lines = ANSI.sub("", out).strip().splitlines()
    assert len(lines) == 2, lines  # the library progress bar is not among them
    assert re.fullmatch(
        CLOCK
        + r' WARNING gateway   circuit breaker open event=breaker_transition peer=cache reason="failure rate 0.6"',
        lines[0],
    ), lines[0]
    # `event` repeating the message is left out; trace ids stay in the JSON lines.
    assert re.fullmatch(CLOCK + r" INFO    gateway   listening port=50051", lines[1]), lines[1]


def test_no_color_on_a_terminal_keeps_the_layout() -> None:
    out = run_in_pty([sys.executable, "-c", SNIPPET, "console"], child_env(NO_COLOR="1"))
    assert "\x1b[" not in out
    assert re.search(CLOCK + r" INFO    gateway   listening port=50051", out)


@pytest.mark.parametrize("how", ["json-on-terminal", "auto-on-pipe"])
def test_json_lines(how: str) -> None:
    if how == "json-on-terminal":
        out = run_in_pty([sys.executable, "-c", SNIPPET, "json"], child_env())
    else:
        out = subprocess.run(
            [sys.executable, "-c", SNIPPET, "auto"], env=child_env(), capture_output=True, text=True, check=True
        ).stderr
    entries = [json.loads(line) for line in out.strip().splitlines()]
    assert [(e["level"], e["service"], e["logger"], e["msg"]) for e in entries] == [
        ("WARNING", "gateway", "llmesh.test", "circuit breaker open"),
        ("INFO", "gateway", "llmesh.test", "listening"),
    ]
    assert entries[0]["peer"] == "cache" and entries[1]["port"] == 50051
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entries[0]["ts"])


SUPERVISED = """
import os, sys
from llmesh.supervisor import Mesh
with Mesh(services=("tokenizer",), echo_logs=True, env={"LLMESH_LOG_LEVEL": "INFO"}) as mesh:
    mesh.echo.say("mesh ready", gateway="none")
"""


def supervised_env(models_dir: os.PathLike[str], **extra: str) -> dict[str, str]:
    return child_env(LLMESH_MODELS_DIR=str(models_dir), **extra)


def test_supervisor_renders_service_lines_on_a_terminal(models_dir: os.PathLike[str]) -> None:
    out = run_in_pty([sys.executable, "-c", SUPERVISED], supervised_env(models_dir))
    assert "\x1b[" in out
    lines = ANSI.sub("", out).strip().splitlines()
    assert not [line for line in lines if line.lstrip().startswith("{")], lines
    assert any(
        re.fullmatch(CLOCK + r" INFO    tokenizer listening port=\d+ metrics_port=\d+ health_port=\d+", ln)
        for ln in lines
    ), lines
    assert any(re.fullmatch(CLOCK + r" INFO    llmesh    mesh ready gateway=none", ln) for ln in lines), lines
    assert any(re.fullmatch(CLOCK + r" INFO    tokenizer stopped", ln) for ln in lines), lines


def test_supervisor_passes_json_lines_when_not_a_terminal(models_dir: os.PathLike[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SUPERVISED],
        env=supervised_env(models_dir),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        check=True,
    ).stderr
    entries = [json.loads(line) for line in out.strip().splitlines()]
    assert {e["service"] for e in entries} == {"tokenizer", "llmesh"}
    assert {"listening", "serving", "stopped"} <= {e.get("event") for e in entries}


def test_a_line_that_is_not_json_is_wrapped_or_rendered() -> None:
    piped = io.StringIO()
    LogEcho("json", piped).passthrough("cache", "Traceback (most recent call last):")
    entry = json.loads(piped.getvalue())
    assert (entry["service"], entry["logger"], entry["msg"]) == (
        "cache",
        "stderr",
        "Traceback (most recent call last):",
    )
    shown = io.StringIO()
    LogEcho("console", shown).show("cache", "Segmentation fault", None)
    assert re.fullmatch(CLOCK + r" INFO    cache     Segmentation fault\n", shown.getvalue())


def test_console_line_bounds_what_it_shows() -> None:
    entry = {"ts": "2026-01-02T03:04:05.678Z", "level": "ERROR", "service": "inference", "msg": "boom"}
    entry.update({f"k{i}": "v" * 200 for i in range(12)})
    entry["trace_id"] = "0" * 32
    entry["exc"] = "Traceback...\nValueError: x"
    line = render_console(entry, color=False)
    first, *rest = line.splitlines()
    assert first.count("=") == 8 and "trace_id" not in first
    assert max(len(part) for part in first.split(" ")) <= 84
    assert rest == ["  Traceback...", "  ValueError: x"]


# A forged line (newline, carriage return), terminal escapes, DEL, a C1 control (CSI), the Unicode
# line and paragraph separators, a tab and NUL.
HOSTILE = "acme\n12:00:00.000 INFO    gateway   forged\r\x1b[31mred\x1b[0m\x7f\x9b\u2028\u2029\t\x00"
HOSTILE_ESCAPED = "acme\\n12:00:00.000 INFO    gateway   forged\\r\\x1b[31mred\\x1b[0m\\x7f\\x9b\\u2028\\u2029\\t\\x00"
# The same without spaces: a field value shown unquoted.
WORD = "acme\n\r\x1b[31mred\x1b[0m\x7f\x9b\u2028\u2029\t\x00"
WORD_ESCAPED = "acme\\n\\r\\x1b[31mred\\x1b[0m\\x7f\\x9b\\u2028\\u2029\\t\\x00"
RAW_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


@pytest.mark.parametrize("color", [False, True])
def test_console_lines_escape_control_characters_from_requests(color: bool) -> None:
    entry = {
        "ts": "2026-01-02T03:04:05.678Z",
        "level": "INFO",
        "service": "gateway",
        "msg": f"request from {HOSTILE}",
        "tenant": WORD,
        "model": HOSTILE,  # has spaces: quoted, as JSON escapes it
        f"k\x1b[2J{WORD[:5]}": 1,
        "exc": f"Traceback (most recent call last):\nValueError: {HOSTILE}",
    }
    line = render_console(entry, color=color)
    first, *rest = line.split("\n")
    # Our own colors are the only escape sequences: none of the text's survives.
    assert not RAW_CONTROLS.search(ANSI.sub("", first)), repr(first)
    assert not RAW_CONTROLS.search(ANSI.sub("", "".join(rest))), repr(rest)
    plain = ANSI.sub("", first)
    assert f"request from {HOSTILE_ESCAPED} " in plain
    assert f" tenant={WORD_ESCAPED} " in plain
    assert ' model="acme\\n12:00:00.000 INFO    gateway   forged\\r\\u001b[31mred' in plain
    assert " k\\x1b[2Jacme\\n=1" in plain
    # A traceback keeps its line breaks, each line indented: what a message forged there stays
    # indented (no line but the record's own starts with a clock), and its controls are escaped.
    assert [ANSI.sub("", r) for r in rest] == [
        "  Traceback (most recent call last):",
        "  ValueError: acme",
        "  " + HOSTILE_ESCAPED.split("\\n", 1)[1],
    ]


def test_supervisor_console_escapes_a_service_line() -> None:
    shown = io.StringIO()
    LogEcho("console", shown).show("cache", "", {"ts": "2026-01-02T03:04:05.678Z", "msg": HOSTILE, "tenant": WORD})
    assert shown.getvalue().count("\n") == 1 and not RAW_CONTROLS.search(shown.getvalue()[:-1])
    assert f"cache     {HOSTILE_ESCAPED} tenant={WORD_ESCAPED}\n" in shown.getvalue()


def test_json_lines_escape_every_control_character() -> None:
    import logging

    from llmesh.telemetry import JsonFormatter

    record = logging.LogRecord("llmesh.test", logging.INFO, __file__, 1, HOSTILE, None, None)
    record.fields = {"tenant": HOSTILE}
    line = JsonFormatter("gateway").format(record)
    assert not RAW_CONTROLS.search(line), repr(line)
    entry = json.loads(line)
    assert entry["msg"] == HOSTILE and entry["tenant"] == HOSTILE

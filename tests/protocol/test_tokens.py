"""Owner tokens: their shape, and what a process can tell from one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from singletask.protocol import tokens
from singletask.protocol.tokens import execution_token, host_id, parse_token, process_state


def test_an_execution_token_with_a_uuid_task_id_fits_in_64_bytes() -> None:
    """Redis keeps a lock hash compact only while every value is at most 64 bytes: a token with a
    UUID task id (Celery's default) stays within that, up to 99 retries and a 7-digit pid."""
    # Given a UUID task id
    task_id = str(uuid.uuid4())

    # When tokens are made for its attempts
    tokens = [execution_token(task_id, retries) for retries in (0, 9, 99)]

    # Then each is at most 64 bytes even with the largest pid Linux hands out (7 digits)
    pid_digits = len(str(os.getpid()))
    for token in tokens:
        assert len(token.encode()) - pid_digits + 7 <= 64, token
    # And a token parses back to its task id, attempt, this host and this process
    assert parse_token(tokens[1]) == (task_id, 9, host_id(), os.getpid())
    assert process_state(tokens[0]) == "alive"


def test_host_id_and_nonce_never_contain_the_separator() -> None:
    """Host id and nonce are base64url: no ``:``, so a token always splits into its five parts."""
    # Given many tokens of one attempt (a new random part each)
    tokens = {execution_token("task", 0) for _ in range(200)}

    # Then they differ, and each splits at the last four colons into the same first parts
    assert len(tokens) == 200
    for token in tokens:
        assert parse_token(token) == ("task", 0, host_id(), os.getpid())
        assert ":" not in host_id()


def test_a_holder_found_alive_is_asked_about_again_only_after_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A refused execution checks that its key's holder lives: a holder found alive is not
    asked about again for ALIVE_FOR seconds (no system call per refusal), and a holder that
    died meanwhile is found gone once they have passed."""
    # Given a holder: another process of this host, alive
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    token = f"task:0:{host_id()}:{process.pid}:nonce"
    asked: list[str] = []
    real = tokens.process_state
    monkeypatch.setattr(tokens, "process_state", lambda t: asked.append(t) or real(t))
    monkeypatch.setattr(tokens, "ALIVE_FOR", 0.5)
    try:
        # When refusals check it, it is asked about once
        assert not tokens.holder_gone(token)
        assert not tokens.holder_gone(token)
        assert asked == [token]
    finally:
        process.kill()
        process.wait()
    # Then once it has died and the while has passed, it is found gone
    assert not tokens.holder_gone(token)  # still taken to be alive
    time.sleep(0.6)
    assert tokens.holder_gone(token)
    # And this process, a reservation and another host are never gone
    assert not tokens.holder_gone(execution_token("task", 0))
    assert not tokens.holder_gone("task:0:-:0:reserved")
    assert not tokens.holder_gone(f"task:0:elsewhere:{process.pid}:nonce")
    assert tokens.this_pid() == os.getpid()

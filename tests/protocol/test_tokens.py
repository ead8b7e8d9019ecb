"""Owner tokens: their shape, and what a process can tell from one."""

from __future__ import annotations

import os
import uuid

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

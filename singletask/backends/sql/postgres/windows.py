"""The SQL of the debounce windows (``lock_debounce``) of the PostgreSQL lock store
(:mod:`singletask.backends.sql.postgres`), beside the rest of its SQL in
:mod:`singletask.backends.sql.postgres.queries`.

A window lives on its key's own row: ``debounce_latest`` (its latest send),
``debounce_opened`` (when it opened; NULL once it is closed, the latest send kept) and
``debounce_until`` (when the record runs out; NULL when there is none), ``debounce_pending``
(until when the latest send is pending, its message being published; NULL once published) and
``debounce_before`` (the superseded send's ``debounce_pending``, kept while the latest is
pending, for DEBOUNCE_UNDO).
"""

from __future__ import annotations

from .queries import SLOT_LOCK_KEY

__all__ = ["DEBOUNCE", "DEBOUNCE_PUBLISHED", "DEBOUNCE_TAKE", "DEBOUNCE_UNDO"]

# The row locked first (inserted free if missing, as a slot acquisition locks it), then, with
# the clock read after the lock, the window's latest send is replaced, opened now unless it is
# open (``debounce_until`` later than now and not closed: ``debounce_opened`` set), and kept
# until ``ttl`` from now or, if an earlier send asked for longer, until then (never shortened);
# pending ``pending`` seconds from now (with ``pending`` > 0), the superseded send's pending
# deadline kept in ``debounce_before``. Returns the send it superseded (NULL when it opened
# the window), the window's age, and the latest send of the closed window it opened a new one
# over (NULL when there was none, or it ran out), which DEBOUNCE_UNDO puts back.
DEBOUNCE = f"""
BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL statement_timeout = {{ms}};
SET LOCAL lock_timeout = {{ms}};
{SLOT_LOCK_KEY};
WITH n AS (SELECT clock_timestamp() AS now),
o AS (SELECT debounce_latest AS latest, debounce_opened AS opened, debounce_pending AS pending,
        coalesce(debounce_until > n.now AND debounce_opened IS NOT NULL, false) AS open,
        coalesce(debounce_until > n.now AND debounce_opened IS NULL, false) AS closed
    FROM {{table}}, n WHERE key = %(base)s)
UPDATE {{table}} AS l SET debounce_latest = %(task_id)s,
    debounce_opened = CASE WHEN o.open THEN o.opened ELSE n.now END,
    debounce_pending = CASE WHEN %(pending)s::float8 > 0
        THEN n.now + %(pending)s::float8 * interval '1 second' END,
    debounce_before = CASE WHEN %(pending)s::float8 > 0 AND o.open THEN o.pending END,
    debounce_until = greatest(l.debounce_until, n.now + %(ttl)s * interval '1 second'),
    expires_at = greatest(l.expires_at, n.now + %(ttl)s * interval '1 second')
FROM o, n WHERE l.key = %(base)s
RETURNING CASE WHEN o.open THEN o.latest END,
    CASE WHEN o.open THEN extract(epoch FROM n.now - o.opened)::float8 ELSE 0 END,
    CASE WHEN o.closed THEN o.latest END;
COMMIT"""

# The pending latest send of the open window was published: it is pending no more, if the
# window still names it.
DEBOUNCE_PUBLISHED = """
UPDATE {table} SET debounce_pending = NULL, debounce_before = NULL
WHERE key = %(key)s AND debounce_latest = %(task_id)s AND debounce_opened IS NOT NULL
    AND debounce_pending IS NOT NULL AND debounce_until > clock_timestamp()"""

# The unexpired window's latest send and the seconds it stays pending (0 unless it is another
# send, pending), the row locked first (so a send that supersedes it commits before, or after
# this). In an open window, another latest send still pending past its deadline (with
# %(overdue)s, still pending at all) is taken back: the caller's send is the latest. The
# window is then closed (``debounce_opened`` and the pending columns NULL, its latest send and
# ``debounce_until`` kept) when it is open and that send is the caller's.
DEBOUNCE_TAKE = """
WITH o AS (SELECT debounce_latest AS latest, debounce_opened AS opened,
        debounce_pending AS pending, clock_timestamp() AS now FROM {table}
    WHERE key = %(key)s AND debounce_until > clock_timestamp() FOR UPDATE),
s AS (SELECT opened, CASE WHEN opened IS NOT NULL AND latest <> %(task_id)s
            AND (pending <= now OR (%(overdue)s AND pending IS NOT NULL))
            THEN %(task_id)s ELSE latest END AS latest,
        CASE WHEN opened IS NOT NULL AND latest <> %(task_id)s AND pending > now
            AND NOT %(overdue)s
            THEN extract(epoch FROM pending - now)::float8 ELSE 0 END AS left_s
    FROM o),
d AS (UPDATE {table} AS l SET debounce_latest = s.latest, debounce_opened = NULL,
        debounce_pending = NULL, debounce_before = NULL
    FROM s WHERE l.key = %(key)s AND s.latest = %(task_id)s AND s.opened IS NOT NULL)
SELECT latest, left_s FROM s"""

# Takes back an unpublished send if the open window still names it, in one statement (one row
# lock): with %(previous)s, the send it superseded is the latest again (the window's opening
# and expiry kept); else with %(closed)s, the closed window it opened a new one over is back
# (``debounce_opened`` NULL, the latest %(closed)s, ``debounce_until`` kept: the longer
# expiry); the restored send pending again until ``debounce_before`` if it was; else the window
# is gone (the row stays, for its other records).
DEBOUNCE_UNDO = """
UPDATE {table} SET debounce_latest = coalesce(%(previous)s::text, %(closed)s::text),
    debounce_opened = CASE WHEN %(previous)s::text IS NULL THEN NULL ELSE debounce_opened END,
    debounce_pending = CASE WHEN %(previous)s::text IS NULL THEN NULL ELSE debounce_before END,
    debounce_before = NULL,
    debounce_until = CASE WHEN %(previous)s::text IS NULL AND %(closed)s::text IS NULL
        THEN NULL ELSE debounce_until END
WHERE key = %(key)s AND debounce_latest = %(task_id)s AND debounce_opened IS NOT NULL
    AND debounce_until > clock_timestamp()"""

"""The interaction campaign (issue 29, "Every send accounted for"): seeded bursts of sends over
the whole option space, bodies ending every way the lifecycle knows, faults at the hand-offs,
and a checker that accounts for every send (see docs/how-it-is-tested.rst; the promises it
checks are on docs/guarantees.rst)."""

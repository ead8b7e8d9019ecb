"""The fault campaign: workers take, renew and release random keys of a real lock store while a
seeded schedule injects faults between them and the store; a checker then reads their histories
(tests/campaigns/faults/history.py). See tests/campaigns/faults/test_campaign.py and
docs/how-it-is-tested.rst."""

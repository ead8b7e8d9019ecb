"""A producer subprocess the campaign kills with SIGKILL at a random moment of its sends.

``python -m tests.campaigns.interactions.producer PLANS LEDGER``: makes the sends of PLANS
(JSON) at their times and appends, for each, a line to LEDGER before the call (the send's intent:
its task id) and one after (what the caller got). A send whose second line is missing was in
flight when the producer was killed: between its store write and its publish, or around them.
Each send goes through the app of its configuration's lock store (the environment names each
store's configurations, URL and queue).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from celery import Celery

from . import app as interactions_app
from .sends import SendPlan, perform
from .space import Config


def main(plan_file: str, ledger_file: str) -> None:
    spec = json.loads(open(plan_file, encoding="utf-8").read())  # noqa: SIM115
    apps: dict[str, Celery] = {}  # configuration -> the app of its store
    for group in json.loads(os.environ[interactions_app.ENV_GROUPS]):
        configs = [Config.from_json(c) for c in group["configs"]]
        app = interactions_app.make_app(
            broker=os.environ[interactions_app.ENV_BROKER],
            results=os.environ[interactions_app.ENV_RESULTS],
            locks=group["locks"],
            queue=group["queue"],
            prefix=os.environ[interactions_app.ENV_PREFIX],
            configs=configs,
        )
        apps.update((c.name, app) for c in configs)
    plans = [SendPlan(**p) for p in spec["plans"]]
    with open(ledger_file, "a", encoding="utf-8") as out:
        for plan in plans:
            delay = spec["start"] + plan.at - time.time()
            if delay > 0:
                time.sleep(delay)
            intent = {
                "seq": plan.seq, "producer": "killed", "config": plan.config, "key": plan.key,
                "method": plan.method, "ending": plan.ending, "t_before": time.time(),
                "task_id": plan.task_id, "countdown": plan.countdown, "fault": plan.fault,
            }  # fmt: skip
            out.write(json.dumps(intent) + "\n")
            out.flush()
            for send in perform(apps[plan.config], plan, spec["run"]):
                out.write(json.dumps(dataclasses.asdict(send)) + "\n")
                out.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

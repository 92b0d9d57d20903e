"""Issue 21's last import loop, as a re-runnable rewrite (idempotent): the pools' KV event logs move into the
manager's layer, so the manager no longer imports the events package and nothing imports back.

- kvservice/events/hub.py -> kvservice/manager/event_log.py (EventHub, EventLog, Subscription, EventsConfig): the
  manager owns one ring per pool; it reads pools through a PoolLocks protocol (no import of manager.pools);
- configure_events (starts the ZeroMQ publishers) -> kvservice/events/publish.py;
- the ScorePrefix request adapter -> kvservice/manager/routing.py (score_prefix_reply).

Run from the repository root: python scripts/move_event_log.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD, NEW = ROOT / "kvservice" / "events" / "hub.py", ROOT / "kvservice" / "manager" / "event_log.py"


def _move() -> None:
    if OLD.exists():
        subprocess.run(["git", "mv", str(OLD.relative_to(ROOT)), str(NEW.relative_to(ROOT))], cwd=ROOT, check=True)
    s = NEW.read_text()
    if "if TYPE_CHECKING:\n    from kvservice.manager.pools import BlockManager\n" in s:
        s = s.replace("if TYPE_CHECKING:\n    from kvservice.manager.pools import BlockManager\n",
                      "\nclass PoolLocks(Protocol):\n"
                      "    \"\"\"What the hub needs of the manager: a pool by name, under its lock.\"\"\"\n\n"
                      "    def locked(self, name: str) -> AbstractContextManager[Any]: ...\n")
        s = s.replace("from typing import TYPE_CHECKING\n", "from typing import Any, Protocol\n")
        s = s.replace("from contextlib import contextmanager\n",
                      "from contextlib import AbstractContextManager, contextmanager\n")
        s = s.replace("manager: BlockManager", "manager: PoolLocks")
    m = re.search(r"\n\ndef configure_events\(.*?(?=\n\n\n|\Z)", s, re.S)
    if m:
        body = m.group(0).strip("\n")
        s = s[:m.start()] + s[m.end():]
        (ROOT / "kvservice" / "events" / "publish.py").write_text(
            '"""A manager about to serve: its KV event settings applied and its ZeroMQ publishers started."""\n\n'
            "from __future__ import annotations\n\n"
            "from kvservice.manager.event_log import EventsConfig\n"
            "from kvservice.manager.pools import BlockManager\n\n\n" + body + "\n")
    s = s.replace("kvservice.events.hub", "kvservice.manager.event_log")
    NEW.write_text(s)
    msg = ROOT / "kvservice" / "events" / "messages.py"
    t = msg.read_text()
    m = re.search(r"\n\ndef score_prefix\(manager: BlockManager, request: pb\.ScorePrefixRequest\).*?(?=\n\n\n|\Z)",
                  t, re.S)
    if m:
        body = m.group(0).strip("\n").replace("def score_prefix(", "def score_prefix_reply(").replace(
            "_score(manager,", "score_prefix(manager,")
        t = t[:m.start()] + t[m.end():]
        msg.write_text(t)
        r = ROOT / "kvservice" / "manager" / "routing.py"
        rt = r.read_text()
        rt = rt.rstrip("\n") + "\n\n\n" + body + "\n"
        r.write_text(rt)


def rewrite(path: Path) -> bool:
    text = path.read_text()
    new = text.replace("from kvservice.events.hub import EventsConfig, configure_events",
                       "from kvservice.events.publish import configure_events\n"
                       "from kvservice.manager.event_log import EventsConfig")
    new = new.replace("from kvservice.events import hub as", "from kvservice.manager import event_log as")
    new = new.replace("kvservice.events.hub", "kvservice.manager.event_log").replace(
        "kvservice/events/hub.py", "kvservice/manager/event_log.py").replace("events/hub.py", "manager/event_log.py")
    new = new.replace("events_proto.score_prefix(self.manager, request)", "score_prefix_reply(self.manager, request)")
    if new != text:
        path.write_text(new)
        return True
    return False


def main() -> int:
    _move()
    files = [p for d in ("kvservice", "tests", "bench", "scripts", "docs") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".md") and "v1" not in p.parts and p.name != "move_event_log.py"]
    changed = [p for p in [*files, ROOT / "README.md"] if p.exists() and rewrite(p)]
    print(f"rewrote {len(changed)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())

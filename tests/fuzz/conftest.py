"""Prints how many hostile cases each fuzzed RPC got, and what it answered, at the end of the run."""

from .support import COUNTS, SAMPLES, VERBOSE


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not COUNTS:
        return
    tr = terminalreporter
    tr.write_sep("-", f"fuzz: {sum(sum(c.values()) for c in COUNTS.values())} hostile cases")
    for service in sorted({s for s, _ in COUNTS}):
        rows = [(rpc, c) for (s, rpc), c in sorted(COUNTS.items()) if s == service]
        tr.write_line(f"{service}: {sum(sum(c.values()) for _, c in rows)} cases")
        for rpc, c in rows:
            codes = ", ".join(f"{k} {v}" for k, v in c.most_common())
            tr.write_line(f"  {rpc:<18} {sum(c.values()):>5}  ({codes})")
    if VERBOSE:
        for (service, rpc, code), msgs in sorted(SAMPLES.items()):
            for msg in sorted(msgs):
                tr.write_line(f"    {service}.{rpc} {code}: {msg}")

"""Prints the soak test's figures (throughput, Step latency p50/p99, errors) at the end of the run."""

RESULTS: dict[str, str] = {}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if RESULTS:
        terminalreporter.write_sep("-", "soak")
        for key, value in RESULTS.items():
            terminalreporter.write_line(f"{key:<28} {value}")

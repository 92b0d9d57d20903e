"""Command-line tools on the client library: kvctl, and the launch helper for started processes."""

"""The journal's SQLite backend: a state directory and the check of its write-ahead log."""

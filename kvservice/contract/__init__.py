"""The contract: what the manager, its clients and its workers all speak.

Generated stubs live in kvservice.v1; this package holds the hand-written side of the wire: errors and their
statuses, array codecs, page tables and their validator, the page-table mirror of incremental replies, the
conversions of specs, and transport security."""

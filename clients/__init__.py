"""What a scheduler imports: BlockManager clients (sync and asyncio) and typed results."""

from .client import BlockManagerClient, ClientError
from .codec import SpaceTables, StepResult

__all__ = ["BlockManagerClient", "ClientError", "SpaceTables", "StepResult"]

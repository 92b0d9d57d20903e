"""Runnable examples: the main job (make run), the reference scheduler, a tiny model and generation."""

"""Trainer loop, loss, optimizer and schedule, checkpoints, logging."""

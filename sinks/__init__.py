"""Participants: one module per external system. Depends only on ``twophase``."""

"""Fixtures and helpers the tests share (servers, users, faults)."""

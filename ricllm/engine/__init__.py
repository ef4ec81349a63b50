"""Requests flow one way: sequence -> scheduler -> model runner -> cache -> output."""

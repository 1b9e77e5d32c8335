"""Numerics studies (multi-step drift and the like); each returns a pandas DataFrame."""
